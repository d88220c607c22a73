"""Processes that heal: database outages waited out, the django-q2 cluster supervised.

``manage.py jobs_worker`` runs ``manage.py qcluster`` as a child in its own process
group and keeps it running (:class:`Supervisor`): it waits for the database before
(re)starting it, restarts it when it exits or makes no progress while messages wait
(the django-q2 wedge, docs/operations.md), forwards SIGTERM/SIGINT, and on stop ends
the child's whole process group. ``manage.py jobs_dispatcher`` wraps each sweep in an
:class:`Outage`. :func:`delivery` wraps each django-q2 task: it marks progress for the
supervisor and turns a failure that escaped the engine into a message without data.

Log lines name processes, durations, error classes and SQLSTATEs, never payloads.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from jobs import retry
from jobs.exceptions import DeliveryFailed
from jobs.outages import (
    DATABASE_ERRORS,
    PING_TIMEOUT,
    REACHED_FILE_ENV,
    Outage,
    close_connections,
    describe,
    pause,
    ping_database,
    touch_supervisor_file,
    wait_for_database,
    within,
)

log = logging.getLogger("jobs.supervisor")
T = TypeVar("T")

# Set by the supervisor for its qcluster: every delivery touches this file.
PROGRESS_FILE_ENV = "JOBS_WORKER_PROGRESS_FILE"


# --- one delivery (inside the qcluster's worker processes) ---------------------------


def _touch_progress() -> None:
    touch_supervisor_file(PROGRESS_FILE_ENV)


@contextlib.contextmanager
def delivery(task: str, ref: int) -> Iterator[None]:
    """Wrap one django-q2 delivery of ``task`` for object ``ref``.

    Marks progress for the supervisor when the delivery begins and ends. An
    exception that escaped the engine (the database refused the claim, or went
    away before an outcome was recorded) is logged by class and code, the broken
    connection is dropped so the worker's next delivery reconnects, and
    ``DeliveryFailed`` is raised instead: django-q2 records the failure (counted
    by ``jobs_stats`` as a failed delivery) and redelivers the unacknowledged
    message after ``Q_CLUSTER['retry']``, without the original message's text.
    """
    _touch_progress()
    try:
        yield
    except Exception as exc:
        reason = describe(exc)
        log.warning(
            "%s %s: delivery failed before an outcome was recorded (%s); "
            "the message is redelivered after Q_CLUSTER['retry']",
            task,
            ref,
            reason,
            extra={"task": task, "ref": ref, "error_code": retry.classify(exc).code},
        )
        if isinstance(exc, DATABASE_ERRORS):
            close_connections()
        raise DeliveryFailed(f"{task} {ref}: {reason}") from None
    finally:
        _touch_progress()


# --- process groups ------------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid`` (Linux /proc; else a probe)."""
    proc = Path("/proc")
    if not proc.is_dir():  # pragma: no cover - not Linux
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    out = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after ')'
            fields = stat.read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def kill_group(pgid: int, *, timeout: float = 10.0) -> bool:
    """SIGKILL every process of group ``pgid``; True once none is left (within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        if not group_members(pgid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


_libc = None


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """In the child, before exec: get SIGTERM if the supervisor dies (Linux prctl)."""
    if _libc is not None:
        _libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _preexec() -> Callable[[], None] | None:
    global _libc
    if not sys.platform.startswith("linux"):  # pragma: no cover
        return None
    with contextlib.suppress(OSError):
        _libc = _libc or ctypes.CDLL(None, use_errno=True)
        return _die_with_parent
    return None  # pragma: no cover


# --- the supervisor ------------------------------------------------------------------


def qcluster_command() -> list[str]:
    """How to start ``manage.py qcluster`` the way this process was started."""
    script = os.path.abspath(sys.argv[0])
    if script.endswith(".py") and os.path.isfile(script):
        return [sys.executable, script, "qcluster"]
    return [sys.executable, "-m", "django", "qcluster"]


def worker_command(queues: list[str]) -> list[str]:
    """The child of ``jobs_worker --queue ...``: a django-q2 cluster whose broker takes
    messages from those queues' lists (``jobs.broker.serving``), started as ``qcluster``
    would be (``manage.py jobs_worker --serve-queues``)."""
    base = qcluster_command()[:-1]
    return [*base, "jobs_worker", "--serve-queues", ",".join(queues)]


def serve_queues(queues: list[str]) -> None:
    """Start a django-q2 cluster for ``queues`` in this process (what ``qcluster`` does,
    with a broker serving every one of their lists)."""
    from django_q.cluster import Cluster

    from jobs import broker
    from jobs.queue import serving_keys

    keys = serving_keys(queues)
    log.info("jobs_worker: serving queues %s (broker lists %s)", queues, keys)
    Cluster(broker.serving(keys)).start()


def messages_waiting(*, stall: float, grace: float, keys: list[str] | None = None) -> str:
    """Why work is waiting for a cluster now, or "" when none is: a job of the served
    queues (``keys``, default the cluster's own) due for over ``grace`` seconds that no
    claim took or held back (a claim that holds a job back gives it a due time ahead). A
    healthy idle cluster claims a job the moment its NOTIFY arrives, and at the latest at
    its next heartbeat. ``stall`` is the caller's: a wedge is this sign seen twice, with
    no progress in between."""
    return _jobs_waiting(grace=grace, keys=keys)


def _jobs_waiting(*, grace: float, keys: list[str] | None) -> str:
    """Where the jobs table is the queue (``jobs.claiming``): a job of the served queues
    due for over ``grace`` seconds that no claim took or held back (a claim that holds a
    job back gives it a due time ahead). A healthy idle cluster claims a job the moment
    its NOTIFY arrives, and at the latest at its next heartbeat."""
    from django.db.models import F
    from django.db.models.functions import Coalesce
    from django.utils import timezone
    from django_q.conf import Conf

    from jobs import rules
    from jobs.claiming import queue_of_key
    from jobs.models import Job

    queues = list(dict.fromkeys(queue_of_key(k) for k in (keys or [Conf.CLUSTER_NAME])))
    since = timezone.now() - timedelta(seconds=grace)
    due = Job.objects.filter(rules.to_q(rules.CLAIMABLE), queue__in=queues)
    due = due.alias(since=Coalesce(F("next_attempt_at"), F("created_at"))).filter(since__lte=since)
    untaken = len(due.values_list("pk", flat=True)[:50])
    if untaken:
        return f"{untaken} job(s) due for over {grace:g} s and not claimed"
    return ""


@dataclass
class Options:
    stall_seconds: float  # no progress this long while messages wait: restart
    stop_timeout: float = 30.0  # graceful stop, then SIGKILL of the group
    max_backoff: float = 5.0  # longest wait between database tries / restarts
    grace: float = 5.0  # a message untaken this long is waiting
    check_every: float = 2.0  # how often the database (the queue, once idle) is looked at
    # A cluster that made no progress this long is looked at this often (a ping, or the
    # stall's look once idle for ``stall_seconds``): one statement; with the ping's own
    # deadline, a database that stopped answering is in the log within seconds. A cluster
    # at work proves the database is there: no look at all.
    ping_every: float = 5.0
    quick_exit: float = 10.0  # a child that ran less than this backs off further
    # Until its first delivery a cluster may still be booting (django imports, N worker
    # processes forked): on a loaded host that can take longer than ``stall_seconds``,
    # and restarting it then only starts the slow boot again.
    boot_grace: float = 30.0
    # One look at the database (a ping, the queue) that takes longer: the database is away.
    ping_timeout: float = PING_TIMEOUT
    # The job queues the cluster serves (``--queue``); empty: ``default`` through qcluster.
    queues: tuple[str, ...] = ()


class Supervisor:
    """Run ``qcluster`` as a child process group and keep it running (see the module doc)."""

    def __init__(self, options: Options, command: list[str] | None = None):
        self.options = options
        queues = list(options.queues)
        if command is None:
            command = worker_command(queues) if queues else qcluster_command()
        self.command = command
        self.child: subprocess.Popen | None = None
        self.started_at = 0.0  # wall clock, compared with the progress file's mtime
        self.resumed_at = 0.0  # wall clock: the database came back (idle time restarts)
        self.signals = 0
        self.restarts = 0
        self.outage = Outage("jobs_worker", cap=options.max_backoff)
        self.progress = Path(
            tempfile.mkstemp(prefix="jobs-worker-", suffix=".progress")[1]
        )  # touched by every delivery of this supervisor's cluster
        # Touched by the cluster's broker when its idle heartbeat reached the database.
        self.reached = Path(tempfile.mkstemp(prefix="jobs-worker-", suffix=".reached")[1])

    # signals -----------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1
        if self.signals == 1:
            log.info("jobs_worker: %s received; stopping", signal.Signals(signum).name)
        elif self.child is not None:
            log.warning("jobs_worker: second signal; killing the cluster now")
            kill_group(self.child.pid, timeout=0)

    def stopping(self) -> bool:
        return self.signals > 0

    # the loop ----------------------------------------------------------------------

    def run(self) -> None:
        """Supervise until SIGTERM/SIGINT."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        quick_exits, checked_connections = 0, False
        try:
            while not self.stopping():
                if not wait_for_database(
                    self.outage, self.stopping, timeout=self.options.ping_timeout
                ):
                    break
                if not checked_connections:
                    checked_connections = True
                    self._check_connections()
                close_connections()  # the child opens its own; none kept open across fork
                self._start()
                ended = self._watch()
                ran = time.time() - self.started_at
                # A stalled cluster runs nothing and may hang in its own graceful stop
                # (the wedge): it is killed at once.
                self._stop(timeout=self.options.stop_timeout if ended is None else 0)
                if ended is None:
                    break
                kind, reason = ended
                quick_exits = quick_exits + 1 if ran < self.options.quick_exit else 0
                delay = (
                    retry.backoff_delay(
                        quick_exits, floor=0.5, base=1.0, cap=self.options.max_backoff
                    )
                    if quick_exits
                    else 0.0
                )
                self.restarts += 1
                log.warning(
                    "jobs_worker: qcluster pid %d %s; it ran %.0f s; restarting in %.1f s "
                    "(restart %d)",
                    self.child.pid,
                    reason,
                    ran,
                    delay,
                    self.restarts,
                    extra={"restart_reason": kind, "restarts": self.restarts},
                )
                pause(delay, self.stopping)
        finally:
            if self.child is not None and self.child.poll() is None:  # pragma: no cover
                self._stop(timeout=0)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            close_connections()
            for path in (self.progress, self.reached):
                with contextlib.suppress(OSError):
                    path.unlink()
        log.info("jobs_worker: stopped after %d restart(s) of qcluster", self.restarts)

    def _check_connections(self) -> None:
        from jobs.checks import check_connections

        try:
            found = within(
                self.options.ping_timeout * 3, lambda: check_connections(databases=["default"])
            )
            for message in found:
                log.warning("jobs_worker: %s (%s) %s", message.id, message.msg, message.hint or "")
        except DATABASE_ERRORS as exc:  # the sizing figures are advice: never a reason to stop
            log.warning("jobs_worker: connection sizing not checked (%s)", describe(exc))

    def _keys(self) -> list[str] | None:
        if not self.options.queues:
            return None
        from jobs.queue import serving_keys

        return serving_keys(list(self.options.queues))

    def _start(self) -> None:
        env = {
            **os.environ,
            PROGRESS_FILE_ENV: str(self.progress),
            REACHED_FILE_ENV: str(self.reached),
        }
        self.child = subprocess.Popen(
            self.command,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopped as a whole
            preexec_fn=_preexec(),  # no threads here; SIGTERM to the child if we die
        )
        self.started_at = time.time()
        log.info(
            "jobs_worker: started qcluster pid %d (process group %d)",
            self.child.pid,
            self.child.pid,
            extra={"child_pid": self.child.pid},
        )

    def _touched(self, path: Path | None = None) -> float:
        """When a delivery of the cluster last began or ended (the progress file's mtime),
        or the mtime of ``path``."""
        try:
            return (path or self.progress).stat().st_mtime
        except OSError:
            return 0.0

    def _quiet_seconds(self) -> float:
        """How long since the cluster last showed it reached the database (a delivery began
        or ended, its idle broker's heartbeat look), its start, or the database's return:
        no boot grace (a ping is cheap). Not a sign of progress: a stall is still seen."""
        shown = max(self._touched(), self._touched(self.reached))
        return time.time() - max(shown, self.started_at, self.resumed_at)

    def _idle_seconds(self) -> float:
        """How long the cluster has made no progress (no delivery began or ended)."""
        touched = self._touched()
        since = max(touched, self.started_at, self.resumed_at)
        if touched < self.started_at:  # no delivery since it started: it may be booting
            since = max(since, self.started_at + self.options.boot_grace)
        return time.time() - since

    def _watch(self) -> tuple[str, str] | None:
        """Wait until the child exits or stalls ((kind, why)) or a signal came (None).

        A cluster at work costs no statement here: its deliveries prove the database is
        there. One that made no progress for ``ping_every`` seconds is looked at every
        ``ping_every`` (an outage, every ``check_every``): a ping, which notices an
        outage while it lasts (the cluster's idle time starts again when the database is
        back), or, once idle for ``stall_seconds``, the look that asks whether work waits
        for it. A stall is declared only when two looks at least ``grace`` apart both
        find work waiting and no progress was made in between, so a cluster catching up
        after an outage no look met (its claims failed meanwhile) is not restarted.
        """
        options = self.options
        next_check, seen_waiting = 0.0, False
        while not self.stopping():
            code = self.child.poll()
            if code is not None:
                return "exited", f"exited with code {code}"
            now = time.monotonic()
            if now >= next_check:
                idle = self._idle_seconds()
                stalled = idle >= options.stall_seconds
                quiet = self._quiet_seconds() >= min(options.ping_every, options.stall_seconds)
                if not self.outage.down and not quiet and not stalled:
                    next_check, seen_waiting = now + options.check_every, False
                    time.sleep(0.1)
                    continue
                waiting = self._look(stalled=stalled)
                if waiting and seen_waiting and self._idle_seconds() >= options.stall_seconds:
                    return "stalled", f"made no progress for {idle:.0f} s while {waiting}"
                seen_waiting = bool(waiting)
                if waiting:
                    # Seen once: looked at again after ``grace``, by when a healthy cluster
                    # catching up after an outage is at work again.
                    every = max(options.check_every, options.grace)
                elif self.outage.down:
                    every = options.check_every
                else:
                    every = options.ping_every
                next_check = now + every
            time.sleep(0.1)
        return None

    def _look(self, *, stalled: bool) -> str:
        """Ping the database, or (``stalled``) ask whether work waits; note outages."""
        try:
            if stalled:
                waiting = within(
                    self.options.ping_timeout,
                    lambda: messages_waiting(
                        stall=self.options.stall_seconds,
                        grace=self.options.grace,
                        keys=self._keys(),
                    ),
                )
            else:
                ping_database(self.options.ping_timeout)
                waiting = ""
        except DATABASE_ERRORS as exc:
            self.outage.failed(exc)
            return ""
        if self.outage.recovered() is not None:
            self.resumed_at = time.time()
            return ""
        return waiting

    def _stop(self, *, timeout: float) -> None:
        """SIGTERM the child (django-q2 stops gracefully), then SIGKILL the rest of its group."""
        child = self.child
        if child is None:
            return
        started = time.monotonic()
        if child.poll() is None and timeout > 0:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "jobs_worker: qcluster pid %d did not stop in %g s; killing its group",
                    child.pid,
                    timeout,
                )
        if not kill_group(child.pid):
            log.error("jobs_worker: processes of group %d outlived SIGKILL", child.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10)
        log.info(
            "jobs_worker: qcluster pid %d and its process group ended in %.1f s",
            child.pid,
            time.monotonic() - started,
        )
