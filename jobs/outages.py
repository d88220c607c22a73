"""The database as a long-running process meets it: outages waited out, looks with deadlines.

``Outage`` counts a loop's failures and logs the first and the recovery (error class
and SQLSTATE, never a payload); ``within`` runs a look on a thread of its own so a
connection cut without a word costs seconds, not minutes; ``wait_for_database`` blocks
until the server answers. The supervisor (``jobs.supervisor``) and the dispatcher use
them; they log under ``jobs.supervisor``, the name operators already filter on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import DatabaseError, InterfaceError, OperationalError, close_old_connections
from django.db import connections as db_connections

from jobs import clock, retry

log = logging.getLogger("jobs.supervisor")
T = TypeVar("T")

# What "the database is not there" raises: refused or reset connections, a server
# shutting down or starting up, too many clients, an administrator's terminate.
DATABASE_ERRORS = (OperationalError, InterfaceError)


def describe(exc: BaseException) -> str:
    """``OperationalError pg_57P01``: the failure's type and the retry table's code, no data."""
    return f"{type(exc).__name__} {retry.classify(exc).code}"


def close_connections() -> None:
    """Drop every open database connection (a broken one would fail the next query too)."""
    for conn in db_connections.all(initialized_only=True):
        with contextlib.suppress(DatabaseError):
            conn.close()


def pause(seconds: float, stopping: Callable[[], bool]) -> None:
    """Sleep ``seconds`` in short steps, returning early once ``stopping()`` is true."""
    deadline = time.monotonic() + seconds
    while not stopping():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(0.1, left))


class Outage:
    """The database outage a loop is in, if any: logged when it begins and when it ends.

    A loop calls :meth:`failed` for every failed try (one log line per outage, not
    per try; the return value is the capped, jittered wait before the next try) and
    :meth:`recovered` after a try that worked (one line with the outage's length).
    """

    def __init__(self, what: str, *, cap: float = 5.0):
        self.what = what
        self.cap = cap
        self.since: float | None = None
        self.tries = 0

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException) -> float:
        """Note a failed try; close the broken connections; return the wait before the next."""
        if self.since is None:
            self.since, self.tries = time.monotonic(), 0
            host, code = _host(), retry.classify(exc).code
            log.warning(
                "%s: database unavailable (%s) on host %s; retrying with backoff up to %gs",
                self.what,
                describe(exc),
                host,
                self.cap,
                extra={"component": self.what, "error_code": code, "host": host},
            )
        self.tries += 1
        close_connections()
        return retry.backoff_delay(self.tries, floor=0.2, base=0.5, cap=self.cap)

    def recovered(self) -> float | None:
        """Note a try that worked; return the outage's length in seconds if one just ended."""
        if self.since is None:
            return None
        seconds = time.monotonic() - self.since
        log.warning(
            "%s: database back after %.1f s (%d failed tries)",
            self.what,
            seconds,
            self.tries,
            extra={"component": self.what, "outage_seconds": round(seconds, 1)},
        )
        self.since = None
        return seconds


def _host() -> str:
    from jobs import conf

    try:
        return conf.host_name()
    except Exception:  # settings unreadable: the system's name still says which host
        return socket.gethostname()


# Set by ``jobs_worker``'s supervisor for its cluster: a file the cluster's broker touches
# when its idle heartbeat look reached the database (``reached_database``). The supervisor
# counts it as a look of its own: an idle cluster's database is then not pinged twice.
REACHED_FILE_ENV = "JOBS_WORKER_REACHED_FILE"


def touch_supervisor_file(env: str) -> None:
    """Touch the file a supervising ``jobs_worker`` named in the environment variable
    ``env`` (its mtime is the sign the supervisor reads); nothing when unsupervised."""
    path = os.environ.get(env)
    if path:
        with contextlib.suppress(OSError):
            os.utime(path)


def reached_database() -> None:
    """Tell a supervising ``jobs_worker`` that this cluster just reached the database."""
    touch_supervisor_file(REACHED_FILE_ENV)


# How long one look at the database may take before the database counts as away. A
# connection that is cut without a word (a partition, a relay or a NAT that stopped
# forwarding: the TCP connection stays open, nothing comes back) would otherwise keep
# a query waiting for many minutes with nothing in the log.
PING_TIMEOUT = 3.0


class _Looker:
    """A daemon thread with its own (kept) connection that runs the supervisor's looks.

    A look past its deadline leaves the thread blocked: it is given up (it closes its
    connection when the look ends) and, until then, the database counts as away
    without a new try; then a new thread serves. At most one blocked thread at a time.
    """

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue | None = None
        self.blocked: threading.Event | None = None  # set once the given-up look ended

    def run(self, seconds: float, call: Callable[[], T]) -> T:
        if self.blocked is not None and not self.blocked.is_set():
            raise OperationalError(
                f"the database did not answer in {seconds:g} s (an earlier look still waits)"
            )
        if self.inbox is None:
            self.inbox = queue.SimpleQueue()
            threading.Thread(
                target=self._serve, args=(self.inbox,), name="jobs-database-look", daemon=True
            ).start()
        answer: queue.SimpleQueue = queue.SimpleQueue()
        ended = threading.Event()
        self.inbox.put((call, answer, ended))
        try:
            ok, value = answer.get(timeout=seconds)
        except queue.Empty:
            self.inbox.put(None)  # the thread stops after the blocked look
            self.inbox, self.blocked = None, ended
            raise OperationalError(f"the database did not answer in {seconds:g} s") from None
        if not ok:
            raise value
        return value

    @staticmethod
    def _serve(inbox: queue.SimpleQueue) -> None:
        try:
            while (item := inbox.get()) is not None:
                call, answer, ended = item
                try:
                    close_old_connections()  # a connection broken by the last look
                    # The look is its connection's health check (no SELECT 1 before it).
                    answer.put((True, clock.checked_by(call)))
                except BaseException as exc:
                    answer.put((False, exc))
                finally:
                    ended.set()
        finally:
            close_connections()  # this thread's own


_looker = _Looker()


def within(seconds: float | None, call: Callable[[], T]) -> T:
    """Run ``call`` on the looker thread (``_Looker``); ``OperationalError`` if it takes
    longer than ``seconds`` (None: run it here, no deadline)."""
    if seconds is None:
        return call()
    return _looker.run(seconds, call)


def _ping() -> None:
    close_old_connections()
    clock.checked_by(_select_one)  # the ping is its own health check: one SELECT 1


def _select_one() -> None:
    with db_connections["default"].cursor() as cursor:
        cursor.execute("SELECT 1")


def ping_database(timeout: float | None = None) -> None:
    """One round trip on the default connection; raises what the driver raises.

    ``timeout``: ``OperationalError`` if no answer came in that many seconds.
    """
    within(timeout, _ping)


def wait_for_database(
    outage: Outage, stopping: Callable[[], bool], *, timeout: float | None = None
) -> bool:
    """Block until the database answers (True) or ``stopping()`` (False).

    ``timeout``: how long one try may wait for an answer (``ping_database``).
    """
    while not stopping():
        try:
            ping_database(timeout)
        except DATABASE_ERRORS as exc:
            pause(outage.failed(exc), stopping)
            continue
        outage.recovered()
        return True
    return False
