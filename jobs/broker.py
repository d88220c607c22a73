"""A django-q2 broker for PostgreSQL: woken by LISTEN/NOTIFY, taking messages with SKIP LOCKED.

Selected by ``Q_CLUSTER["broker_class"] = "jobs.broker.PostgresBroker"`` (keep
``Q_CLUSTER["orm"]``: it names the database, and django-q2's admin lists the
queued tasks from the same ``django_q_ormq`` table). The rows and their meaning
are the ORM broker's, so the two can share a queue during a rolling deploy:

- ``enqueue`` inserts the row and ``pg_notify``s the queue's channel in one
  statement, on the caller's connection: inside the caller's transaction the
  message, the job row and the wake-up commit together, and a rolled-back
  enqueue wakes nobody. NOTIFY folds identical notifications of one transaction,
  so a burst of 83 jobs in one commit is one wake-up.
- ``dequeue`` takes up to ``bulk`` due messages (``lock`` passed) in one
  statement, ``FOR UPDATE SKIP LOCKED``, moving their ``lock`` to now +
  ``retry`` as the ORM broker does: a message dequeued and never acknowledged is
  handed out again after ``retry``. Every time is the database server's clock.
- An idle pusher waits on ``LISTEN`` (its own psycopg connection, autocommit)
  instead of sleeping ``poll``: it sends nothing between wake-ups but one query
  at the nearest lock expiry (a redelivery due) or every ``broker_heartbeat``
  seconds (default 5), which also picks up messages enqueued without a NOTIFY
  (the ORM broker of a host not yet upgraded).
- A listener that fails is dropped: the pusher polls every ``poll`` as the ORM
  broker does and tries to listen again every ``broker_listen_retry`` seconds
  (default 2). A new listener is trusted once it hears a probe notification sent
  from the pusher's other connection; one that does not (behind a pooler in
  transaction mode the LISTEN's server session goes back to the pool) is dropped
  and the pusher polls, trying again after a minute.
  ``Q_CLUSTER["broker_listen"] = False`` polls from the start.

- ``delayed(seconds)`` gives a broker whose messages no pusher takes before their due
  time (``lock`` = now + seconds): ``async_task(..., broker=get_broker().delayed(s))``;
  pushers wake at that time as for a redelivery.

The engine's jobs and effects have no message here: the claiming broker built on this
one (``jobs.claiming.ClaimingBroker``) claims them from their rows and takes plain
django-q2 messages (``async_task`` of other functions) with this class's statements.

On SQLite this broker refuses to start: the ORM broker stays there.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import time
import uuid
from typing import Any

from django.db import DatabaseError, InterfaceError, connections
from django.utils import timezone
from django_q.brokers import Broker
from django_q.brokers.orm import ORM
from django_q.conf import Conf

try:  # the PostgreSQL broker's own connection; off PostgreSQL (SQLite, no psycopg) the
    # claiming broker there uses only this module's names (OrmQueues, channel_for)
    import psycopg
    from psycopg import sql
except ImportError:  # pragma: no cover - a project without psycopg
    psycopg = sql = None

log = logging.getLogger("jobs.broker")

TABLE = "django_q_ormq"
CHANNEL_PREFIX = "django_q_"
PROBE_PREFIX = "probe:"
# The longest an idle dequeue() waits before handing back to the pusher, which checks
# its stop event between calls: a stopping cluster waits at most this for its pusher.
WAIT_SLICE = 0.5
# How long a new listener waits to hear the probe before it is not trusted, and how long
# the pusher then polls before trying again (each try costs the pusher PROBE_TIMEOUT).
PROBE_TIMEOUT = 1.0
DEAF_RETRY = 60.0

ENQUEUE = f"""
WITH message AS (
    INSERT INTO {TABLE} (key, payload, lock)
    VALUES (%s, %s, now() + make_interval(secs => %s)) RETURNING id
)
SELECT id, pg_notify(%s, '') FROM message
"""

# The due messages, oldest first, locked by this statement or skipped; their lock moves
# to now + retry (redelivery after ``retry``, as django-q2's ORM broker does it).
_TAKE = f"""
WITH picked AS MATERIALIZED (
    SELECT id FROM {TABLE}
    WHERE key = ANY(%(keys)s) AND lock < now()
    ORDER BY id
    LIMIT %(bulk)s
    FOR UPDATE SKIP LOCKED
), taken AS (
    UPDATE {TABLE} AS q SET lock = now() + make_interval(secs => %(retry)s)
    FROM picked WHERE q.id = picked.id
    RETURNING q.id, q.payload
)
"""
TAKE = _TAKE + "SELECT id, payload, NULL::float8 FROM taken"
# The same, and when the next lock of the queue runs out (seconds from now, NULL when
# none does): an idle pusher wakes then for the redelivery. The second part reads the
# statement's snapshot, without the rows the first part takes.
TAKE_AND_NEXT_DUE = (
    TAKE
    + f"""
UNION ALL
SELECT NULL, NULL, EXTRACT(EPOCH FROM min(lock) - now())::float8
FROM {TABLE} WHERE key = ANY(%(keys)s) AND lock >= now()
"""
)
# A worker's follow-on (jobs.tasks): acknowledge the message whose outcome has just
# committed and take the next due message of the same list, in one statement (the list
# is the acknowledged message's own when not given: django-q2's pusher overwrites the
# task's ``cluster`` with the cluster's name). The taken message is locked as a pusher's
# dequeue locks it: unacknowledged, it is handed out again after ``retry``.
FOLLOW = f"""
WITH acked AS (DELETE FROM {TABLE} WHERE id = %(ack)s RETURNING key), picked AS MATERIALIZED (
    SELECT id FROM {TABLE}
    WHERE key = COALESCE(%(key)s, (SELECT key FROM acked)) AND lock < now()
    ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED
)
UPDATE {TABLE} AS q SET lock = now() + make_interval(secs => %(retry)s)
FROM picked WHERE q.id = picked.id RETURNING q.id, q.payload, q.key
"""
NEXT_DUE = (
    f"SELECT EXTRACT(EPOCH FROM min(lock) - now())::float8 FROM {TABLE} "
    "WHERE key = ANY(%s) AND lock >= now()"
)


class DeafListener(Exception):
    """Raised when a new LISTEN connection does not hear a notification another session sent."""


def channel_for(list_key: str) -> str:
    """The NOTIFY channel of a queue (an identifier: at most 63 bytes)."""
    name = CHANNEL_PREFIX + list_key
    if len(name.encode()) <= 63:
        return name
    return CHANNEL_PREFIX + hashlib.sha256(list_key.encode()).hexdigest()[:40]


def channel_sql(queue: str) -> str:
    """``channel_for(queue.list_key(<queue>))`` in SQL over the column ``queue``, for a
    statement that NOTIFYs the queues of the rows it wrote. Its parameters, in order, are
    ``channel_params()``; ``tests/jobs/test_sequences.py`` holds it to ``channel_for``."""
    from jobs.rules import DEFAULT_QUEUE

    default = f"{queue} IN ('', '{DEFAULT_QUEUE}')"
    key = f"CASE WHEN {default} THEN %s::text ELSE %s || '.' || {queue} END"
    return (
        f"(SELECT CASE WHEN octet_length(%s || k) <= 63 THEN %s || k ELSE %s || "
        f"left(encode(sha256(convert_to(k, 'UTF8')), 'hex'), 40) END FROM (SELECT {key} AS k) c)"
    )


def channel_params() -> list[str]:
    """``channel_sql``'s parameters: the prefix thrice, django-q2's cluster name (the
    default queue's list) and its prefix (every other queue's list starts with it)."""
    from django_q.conf import Conf

    return [CHANNEL_PREFIX, CHANNEL_PREFIX, CHANNEL_PREFIX, Conf.CLUSTER_NAME, Conf.PREFIX]


def _option(name: str, default: Any) -> Any:
    from django.conf import settings

    return (getattr(settings, "Q_CLUSTER", None) or {}).get(name, default)


class PostgresBroker(Broker):
    """django-q2's ORM broker's table and semantics, woken by NOTIFY instead of polling."""

    def __init__(self, list_key: str | None = None, *, keys: list[str] | None = None) -> None:
        super().__init__(list_key=list_key)
        self._delay = 0.0
        # The lists a pusher takes from (``jobs_worker --queue``); enqueue uses ``key``.
        self.keys = list(keys or [])
        self._reset_listener()

    def __getstate__(self) -> tuple:
        return (*super().__getstate__(), self.keys)

    def __setstate__(self, state: tuple) -> None:
        *base, self.keys = state
        super().__setstate__(tuple(base))
        self._delay = 0.0
        self._reset_listener()

    @property
    def served(self) -> list[str]:
        return self.keys or [self.key]

    def delayed(self, seconds: float) -> PostgresBroker:
        """This broker, enqueueing messages no pusher takes for ``seconds`` (server clock).

        For work due later (a retry's backoff, ``run_after``):
        ``async_task(..., broker=get_broker().delayed(s))``. The message's ``lock`` is its
        due time, as a taken message's is its redelivery time; its NOTIFY makes idle
        pushers look, find it not yet due, and wake again when it is.
        """
        other = PostgresBroker(list_key=self.list_key)
        other._delay = max(0.0, float(seconds))
        return other

    def _reset_listener(self) -> None:
        self._listener: psycopg.Connection | None = None
        self._listener_pid = 0
        self._listen_after = 0.0  # monotonic: the earliest next attempt to listen
        self._busy = False  # the last take found messages: look again at once
        self._woken = True  # a notification (or a fresh start) asks for a look
        self._next_look = 0.0  # monotonic: heartbeat or the nearest lock expiry

    # --- the Broker interface ---------------------------------------------------------

    @staticmethod
    def get_connection(list_key: str | None = None) -> str:
        """The database alias (``Q_CLUSTER['orm']``); connections are looked up per call."""
        alias = Conf.ORM or "default"
        vendor = connections[alias].vendor
        if vendor != "postgresql":
            raise RuntimeError(
                f"jobs.broker.PostgresBroker needs PostgreSQL; database {alias!r} is "
                f"{vendor}: use django-q2's ORM broker (leave Q_CLUSTER['broker_class'] unset)"
            )
        return alias

    @property
    def key(self) -> str:
        return self.list_key or Conf.CLUSTER_NAME

    @property
    def channel(self) -> str:
        return channel_for(self.key)

    def info(self) -> str:
        if not self._info:
            self._info = f"PostgreSQL LISTEN/NOTIFY {self.connection}"
        return self._info

    def ping(self) -> bool:
        return True

    def enqueue(self, task: str) -> int:
        """Insert the message and notify its channel, in the caller's transaction."""
        row = self._execute(ENQUEUE, [self.key, task, self._delay, self.channel], fetch="one")
        return row[0]

    def dequeue(self) -> list[tuple[int, str]] | None:
        """Up to ``bulk`` due messages; when there are none, wait for a NOTIFY (or ``poll``)."""
        try:
            return self._dequeue()
        except (DatabaseError, InterfaceError) as exc:
            # The database is away (a restart, a cut): drop the connection, wait a little
            # and let the pusher ask again, instead of the pusher dying on it.
            log.warning("queue %s: dequeue failed (%s); retrying", self.key, type(exc).__name__)
            self._close_django_connection()
            self._busy = False
            self._woken = True
            time.sleep(max(Conf.POLL, 1.0))
            return None

    def queue_size(self) -> int:
        sql_text = f"SELECT count(*) FROM {TABLE} WHERE key = ANY(%s) AND lock <= now()"
        return self._execute(sql_text, [self.served], fetch="one")[0]

    def lock_size(self) -> int:
        sql_text = f"SELECT count(*) FROM {TABLE} WHERE key = ANY(%s) AND lock > now()"
        return self._execute(sql_text, [self.served], fetch="one")[0]

    def purge_queue(self) -> int:
        return self._execute(f"DELETE FROM {TABLE} WHERE key = %s", [self.key])

    def delete_queue(self) -> int:
        return self.purge_queue()

    def delete(self, task_id: int) -> None:
        self._execute(f"DELETE FROM {TABLE} WHERE id = %s", [task_id])

    def acknowledge(self, task_id: int) -> None:
        self.delete(task_id)

    def fail(self, task_id: int) -> None:
        self.delete(task_id)

    # --- dequeue --------------------------------------------------------------------

    def _dequeue(self) -> list[tuple[int, str]] | None:
        listening = self._ensure_listener()
        if not listening:
            tasks = self._take()
            if tasks:
                return tasks
            time.sleep(Conf.POLL)  # polling, as the ORM broker does
            return None
        if self._busy or self._woken or time.monotonic() >= self._next_look:
            tasks = self._take()
            if tasks:
                return tasks
        if self._wait():
            return self._take() or None
        return None

    def _take(self) -> list[tuple[int, str]]:
        """One statement: take due messages; when idle, also learn the next lock expiry."""
        idle = not self._busy
        params = {"keys": self.served, "bulk": max(1, int(Conf.BULK)), "retry": float(Conf.RETRY)}
        rows = self._execute(TAKE_AND_NEXT_DUE if idle else TAKE, params, fetch="all")
        tasks = sorted((r[0], r[1]) for r in rows if r[0] is not None)
        self._woken = False
        self._busy = bool(tasks)
        if tasks:
            return tasks
        due = [r[2] for r in rows if r[0] is None]
        if not idle:
            due = [self._execute(NEXT_DUE, [self.served], fetch="one")[0]]
        self._plan_next_look(due[0] if due else None)
        return tasks

    def _plan_next_look(self, due_in: float | None) -> None:
        wait = float(_option("broker_heartbeat", 5.0))
        if due_in is not None:
            wait = min(wait, max(0.0, due_in) + 0.005)
        self._next_look = time.monotonic() + wait

    def _wait(self) -> bool:
        """Wait for a notification until the next look or a slice; True when one came."""
        timeout = max(0.0, min(WAIT_SLICE, self._next_look - time.monotonic()))
        listener = self._listener
        try:
            for note in listener.notifies(timeout=timeout):
                if not note.payload.startswith(PROBE_PREFIX):
                    self._woken = True
                    break
        except psycopg.Error as exc:
            self._drop_listener(f"listener failed ({type(exc).__name__})")
            self._woken = True  # notifications may have been missed: look now
            return True
        if not self._woken:
            return False
        # Drain what else arrived: one look serves them all.
        try:
            for _note in listener.notifies(timeout=0):
                pass
        except psycopg.Error as exc:
            self._drop_listener(f"listener failed ({type(exc).__name__})")
        return True

    # --- the listener ---------------------------------------------------------------

    def _ensure_listener(self) -> bool:
        """Whether a trusted LISTEN connection of this process is up; try to open one when due."""
        if self._listener is not None and self._listener_pid != os.getpid():
            # Inherited through a fork: the socket is the parent's; never close it here.
            self._listener = None
        if self._listener is not None:
            if not self._listener.closed:
                return True
            self._drop_listener("listener connection closed")
        if not _option("broker_listen", True) or time.monotonic() < self._listen_after:
            return False
        try:
            self._listener = self._open_listener()
        except DeafListener:
            self._listener = None
            self._listen_after = time.monotonic() + DEAF_RETRY
            log.warning(
                "queue %s: the listener hears no other session (a pooler in transaction "
                "mode?); polling every %ss, trying again in %ss (Q_CLUSTER['broker_listen'] "
                "= False polls without trying)",
                self.key,
                Conf.POLL,
                DEAF_RETRY,
            )
            return False
        except (psycopg.Error, DatabaseError, InterfaceError, OSError) as exc:
            self._listener = None
            self._listen_after = time.monotonic() + float(_option("broker_listen_retry", 2.0))
            log.warning(
                "queue %s: cannot listen (%s); polling every %ss",
                self.key,
                type(exc).__name__,
                Conf.POLL,
            )
            return False
        self._listener_pid = os.getpid()
        self._woken = True  # what was enqueued while nobody listened: look now
        log.info("queue %s: listening on %s", self.key, self.channel)
        return True

    def _open_listener(self) -> psycopg.Connection:
        params = dict(connections[self.connection].get_connection_params())
        for name in ("cursor_factory", "context", "prepare_threshold"):
            params.pop(name, None)
        params.setdefault("application_name", f"django-q2 listener {self.key}"[:63])
        # A dead peer is noticed by TCP keepalives (a silent cut never wakes a reader).
        params.setdefault("keepalives", 1)
        params.setdefault("keepalives_idle", 10)
        params.setdefault("keepalives_interval", 3)
        params.setdefault("keepalives_count", 3)
        params.setdefault("connect_timeout", 5)
        conn = psycopg.connect(autocommit=True, **params)
        try:
            for key in self.served:  # one channel per list served
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_for(key))))
            # Hear a probe sent by another session before trusting the listener: behind a
            # pooler in transaction mode the LISTEN's server connection goes back to the
            # pool, and only its own notifications would still come back to it.
            probe = PROBE_PREFIX + uuid.uuid4().hex
            self._execute("SELECT pg_notify(%s, %s)", [self.channel, probe], fetch="one")
            deadline = time.monotonic() + PROBE_TIMEOUT
            while time.monotonic() < deadline:
                for note in conn.notifies(timeout=max(0.0, deadline - time.monotonic())):
                    if note.payload == probe:
                        return conn
            raise DeafListener("the listener did not hear a probe from another session")
        except BaseException:
            conn.close()
            raise

    def _drop_listener(self, why: str) -> None:
        listener, self._listener = self._listener, None
        if listener is not None and self._listener_pid == os.getpid():
            with contextlib.suppress(Exception):  # closing a broken connection may fail too
                listener.close()
        self._listen_after = 0.0  # try again at the next call, then every listen_retry
        log.warning("queue %s: %s; polling until listening again", self.key, why)

    def close(self) -> None:
        """Close this process's listener (tests and benchmarks)."""
        if self._listener is not None and self._listener_pid == os.getpid():
            self._listener.close()
        self._listener = None

    # --- statements on Django's connection ------------------------------------------

    def _execute(self, sql_text: str, params: Any, *, fetch: str = "") -> Any:
        conn = connections[self.connection]
        if conn.errors_occurred and conn.get_autocommit():
            # Django's own recovery (it pings only after an error, so none on the hot path).
            conn.close_if_unusable_or_obsolete()
        try:
            with conn.cursor() as cur:
                cur.execute(sql_text, params)
                if fetch == "one":
                    return cur.fetchone()
                if fetch == "all":
                    return cur.fetchall()
                return cur.rowcount
        except (DatabaseError, InterfaceError):
            if conn.get_autocommit():
                self._close_django_connection()
            raise

    def _close_django_connection(self) -> None:
        conn = connections[self.connection]
        if conn.in_atomic_block:
            return
        with contextlib.suppress(Exception):  # the connection is broken already
            conn.close()


# --- a worker serving several queues (``manage.py jobs_worker --queue``) ----------------


class OrmQueues(ORM):
    """django-q2's ORM broker taking messages from several lists (one per job queue).

    The same rows, locks and acknowledgement as the ORM broker; only ``dequeue`` and
    the sizes look at every list in ``keys``. Enqueueing uses ``list_key`` as usual.
    """

    def __init__(self, list_key: str | None = None, *, keys: list[str] | None = None) -> None:
        super().__init__(list_key=list_key)
        self.keys = list(keys or [self.list_key])

    def __getstate__(self) -> tuple:
        return (*super().__getstate__(), self.keys)

    def __setstate__(self, state: tuple) -> None:
        *base, self.keys = state
        super().__setstate__(tuple(base))

    def queue_size(self) -> int:
        now = timezone.now()
        return self.get_connection().filter(key__in=self.keys, lock__lte=now).count()

    def lock_size(self) -> int:
        now = timezone.now()
        return self.get_connection().filter(key__in=self.keys, lock__gt=now).count()

    def dequeue(self):
        """Up to ``bulk`` due messages of any served list, oldest first (as the ORM
        broker's: each taken by moving its lock, a lost race skips it)."""
        tasks = self.get_connection().filter(key__in=self.keys, lock__lt=timezone.now())
        taken = []
        for task in tasks.order_by("id")[: Conf.BULK]:
            moved = (
                self.get_connection()
                .filter(id=task.id, lock=task.lock)
                .update(lock=self.timeout(task))
            )
            if moved:
                taken.append((task.pk, task.payload))
        if taken:
            return taken
        time.sleep(Conf.POLL)
        return None


def serving(keys: list[str]) -> Broker:
    """The configured broker, taking messages from every list in ``keys`` (the first is
    its own, for what the cluster itself enqueues: schedules)."""
    if Conf.BROKER_CLASS:
        module, name = Conf.BROKER_CLASS.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        if not issubclass(cls, (PostgresBroker, OrmQueues)):
            raise RuntimeError(
                f"{Conf.BROKER_CLASS} cannot serve several queues: use django-q2's ORM "
                "broker or jobs.broker.PostgresBroker (or one worker per queue)"
            )
        return cls(list_key=keys[0], keys=keys)
    if not Conf.ORM:
        raise RuntimeError("jobs_worker --queue needs the ORM broker (Q_CLUSTER['orm'])")
    return OrmQueues(list_key=keys[0], keys=keys)
