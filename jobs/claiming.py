"""The jobs table as django-q2's queue: a broker whose dequeue claims due jobs.

Selected by ``Q_CLUSTER["broker_class"] = "jobs.claiming.ClaimingBroker"`` (PostgreSQL).
No engine job has a message: a job's row is its queue entry. django-q2's cluster stays
the worker runtime; its pusher calls ``dequeue``, which

- claims, for each idle worker of the cluster, the next due job of the served queues
  (``jobs.executors.pgclaim``: locked before admission, ``SKIP LOCKED``), started under
  this cluster's owner identity with its lease and attempt row, and hands the worker an
  in-memory signed django-q2 package naming exactly that job and its attempt
  (``jobs.tasks.run_claimed``): the worker adopts the claim, it does not claim again;
- leases the ledger's due sends (``jobs.tasks.release_claimed``), taking turns with the
  jobs, and takes plain django-q2 messages (``async_task`` of other functions, restores)
  from ``django_q_ormq`` as ``jobs.broker.PostgresBroker`` does, taking turns with the
  jobs so that neither waits for the other to drain;
- when idle, waits on ``LISTEN`` (an enqueue ``NOTIFY``s in its transaction) and on a
  pipe its workers write to when they finish, until the nearest due time (a retry, a
  ``run_after``, a lease that runs out, a held message).

Idle workers: a counter in shared memory, raised by the pusher for each task it hands
out and lowered by the worker when the task ends (``post_execute_in_worker``); a worker
killed in a task never lowers it, so a cluster whose count stood full and unchanged
longer than django-q2's ``timeout`` (no task outlives it) starts counting again from 0.
There is nothing to acknowledge for a claimed job: its publish committed its outcome.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import multiprocessing
import os
import select
import time
import uuid
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, InterfaceError
from django.dispatch import receiver
from django.utils import timezone
from django_q.conf import Conf
from django_q.signals import post_execute_in_worker
from django_q.signing import SignedPackage

from jobs import conf, rules
from jobs.broker import TABLE, TAKE, PostgresBroker
from jobs.outages import reached_database

log = logging.getLogger("jobs.claiming")

RUN_CLAIMED = "jobs.tasks.run_claimed"
RELEASE_CLAIMED = "jobs.tasks.release_claimed"
# What a worker writes to the pusher's wake pipe when its task ended.
CLAIMED_ENDED, PLAIN_ENDED = b"j", b"p"
# The longest an idle pusher waits without looking at the table (``broker_heartbeat``):
# a NOTIFY that never arrived (a listener reconnecting) is made up for by then. Each look
# is one statement (``Claiming.dequeue``).
HEARTBEAT = 10.0
# How often a busy cluster looks for jobs that need their own verdict (a lease that ran
# out, a spent budget): an idle one looks when its nearest due time has come.
OWN_VERDICT_EVERY = 1.0

# The cluster's shared state, made before django-q2 forks its pusher and workers:
# (tasks in hand, the wake pipe's read end, its write end).
_shared: tuple[Any, int, int] | None = None


def _make_shared() -> tuple[Any, int, int]:
    global _shared
    if _shared is None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        _shared = (multiprocessing.Value("i", 0), r, w)
    return _shared


def queue_of_key(key: str) -> str:
    """The job queue a broker list serves (``jobs.queue.list_key``'s inverse)."""
    prefix = f"{Conf.PREFIX}."
    if key.startswith(prefix) and key != Conf.CLUSTER_NAME:
        return key[len(prefix) :]
    return rules.DEFAULT_QUEUE


_NEXT_JOB_DUE = """
SELECT EXTRACT(EPOCH FROM min(due) - clock_timestamp())::float8 FROM (
    SELECT min(w.due) AS due FROM unnest(%(queues)s::varchar[]) AS served(queue),
    LATERAL (
        SELECT COALESCE(next_attempt_at, created_at) AS due FROM {t}
        WHERE queue = served.queue AND state IN ('queued', 'retry_wait') AND held_by = ''
        ORDER BY COALESCE(next_attempt_at, created_at) LIMIT 1
    ) w
    UNION ALL
    SELECT min(lease_expires_at) FROM {t}
    WHERE queue = ANY(%(queues)s) AND state = 'running'
    UNION ALL
    SELECT min(lock) FROM {q} WHERE key = ANY(%(keys)s) AND lock >= now()
    UNION ALL
    SELECT min(COALESCE(next_attempt_at, clock_timestamp())) FROM {e}
    WHERE %(releases)s AND state IN ('pending', 'unknown')
    UNION ALL
    SELECT min(lease_expires_at) FROM {e} WHERE %(releases)s AND state = 'sending'
) d
"""


@dataclass(frozen=True)
class Leased:
    """An effect leased for sending (``effect_machine.claim_send``) and its state before."""

    effect: Any
    prior: str


def claims():
    """The claims of this process's executor: one statement each on PostgreSQL through
    psycopg 3 (``jobs.executors.pgclaim``), the ORM's elsewhere (``ormclaim``)."""
    from jobs import executors

    if executors.current().name == "postgres":
        from jobs.executors import pgclaim

        return pgclaim
    from jobs.executors import ormclaim

    return ormclaim


class Claimer:
    """Claims the next due job of ``queues`` for this cluster (its pusher, or a worker that
    keeps going): the queues take turns, and a job that needs its own verdict (a lease
    that ran out, a spent budget) is looked for first, once a second while busy."""

    def __init__(self, queues: list[str]) -> None:
        self.queues = list(queues)
        self._own_verdict_at = 0.0  # monotonic: the last look (0: look at the next claim)
        self._queue_turn = 0
        # Effect releases are the default queue's (as their messages were on the message
        # brokers); they take turns with its jobs.
        self.releases = rules.DEFAULT_QUEUE in self.queues
        self._effect_turn = False
        self._sends_found = True  # the last look for a due send found one

    def look_now(self) -> None:
        self._own_verdict_at = 0.0

    def next(self, owner: str, *, busy: bool = True):
        """The next claim for ``owner``: a job's (``jobs.engine.plan.Claim``, won) or an
        effect's lease (``Leased``), or None when nothing is due that this cluster may
        start now."""
        if self.releases:
            # Busy, jobs and sends take turns; woken from idle (an enqueue's NOTIFY), the
            # job is looked for first: a statement fewer before it starts.
            self._effect_turn = busy and not self._effect_turn
            if self._effect_turn:
                leased = self._send(owner, busy=busy)
                if leased is not None:
                    return leased
        claim = self._next_job(owner, busy=busy)
        if claim is None and self.releases and not self._effect_turn:
            return self._send(owner, busy=busy)
        return claim

    def _send(self, owner: str, *, busy: bool) -> Leased | None:
        """The ledger's next due send, leased to ``owner``. Idle, or while the last look
        found none, the effect claim looks first outside a transaction (one statement
        when none is due, four otherwise); while sends are found, it goes straight in."""
        look_first = not busy or not self._sends_found
        leased = claims().claim_effect(owner, look_first=look_first)
        self._sends_found = leased is not None
        return None if leased is None else Leased(*leased)

    def _next_job(self, owner: str, *, busy: bool):
        pgclaim = claims()
        lease, bound = conf.lease_seconds(), conf.tenant_concurrency()
        now = time.monotonic()
        looked = self._own_verdict_at
        if looked == 0.0 or (busy and now - looked >= OWN_VERDICT_EVERY):
            self._own_verdict_at = now
            # Busy queues seldom find nothing: the sequences' heads are looked at here too.
            pgclaim.release_heads()
            for queue in self.queues:
                claim = pgclaim.decide_own_verdict(queue, owner, lease=lease, bound=bound)
                if claim is not None and claim.won:
                    return claim
        self._queue_turn += 1
        for i in range(len(self.queues)):
            queue = self.queues[(self._queue_turn + i) % len(self.queues)]
            for _ in range(4):  # a picked job held back is deferred: look at the next
                claim = pgclaim.claim_next(queue, owner, lease=lease, bound=bound)
                if claim is None:
                    break
                if claim.won:
                    return claim
        return None


class Claiming:
    """What a broker whose dequeue claims needs beside its table of plain messages: the
    idle count, the turns, the packages. A broker class adds ``served``, ``_take_plain``,
    ``_wait_for_work`` and ``_close_django_connection``; its table's broker takes
    ``(list_key, keys=)``."""

    remembers_empty = False  # a broker whose wait hears every cause of new work says True

    def __init__(self, list_key: str | None = None, *, keys: list[str] | None = None) -> None:
        super().__init__(list_key=list_key, keys=keys)
        _make_shared()
        self._reset_claiming()

    def __setstate__(self, state: tuple) -> None:
        super().__setstate__(state)
        self._reset_claiming()

    def _reset_claiming(self) -> None:
        self._turn = 0  # whose turn a contested slot is: even jobs, odd plain messages
        self._claimer = Claimer(self.queues)
        self._busy = False  # the last dequeue handed out work
        self._full_since = (-1, 0.0)  # (count, monotonic) while every worker is busy
        self._quiet_wake = False  # the last wait ended by its timeout, nothing else
        self.handed_early = False  # the last dequeue returned before filling every worker
        # The last look for a job (a plain message) found none, and nothing since could
        # have made one due: no NOTIFY, no claimed task ended, no due time came
        # (``ClaimingBroker._wait_for_work`` forgets them). The next fill skips that look.
        self._jobs_empty = self._plain_empty = False

    @property
    def queues(self) -> list[str]:
        return list(dict.fromkeys(queue_of_key(k) for k in self.served))

    @property
    def capacity(self) -> int:
        return max(1, int(Conf.WORKERS or 1))

    # --- the Broker interface ---------------------------------------------------------

    def dequeue(self) -> list[tuple[int, str]] | None:
        """Claimed jobs and plain messages for the idle workers; waits when there is none.

        Woken by the heartbeat alone (no NOTIFY, no worker done, no due time reached),
        one look at the nearest due time decides whether to claim at all: an idle
        cluster sends one statement a heartbeat, not a claim per queue and source."""
        try:
            idle = self._idle()
            if idle and self._quiet_wake:
                self._quiet_wake = False
                due_in = self._next_due()
                reached_database()  # a supervising jobs_worker need not ping it now
                if due_in is None or due_in > 0:
                    self._wait_for_work(due_in)
                    return None
            tasks = self._fill(idle)
            if idle:  # a full cluster found nothing because it looked for nothing
                # Busy with claimed work (jobs, sends), not with a plain message (the
                # dispatcher's minute): only that makes a look for expired leases due.
                self._busy = any(ack == 0 for ack, _ in tasks)
            if tasks:
                return tasks
            self._wait_for_work()
            return None
        except (DatabaseError, InterfaceError) as exc:
            self._jobs_empty = self._plain_empty = False
            log.warning("queues %s: claim failed (%s); retrying", self.queues, type(exc).__name__)
            self._close_django_connection()
            time.sleep(max(Conf.POLL, 1.0))
            return None

    def acknowledge(self, task_id: int) -> None:
        """A plain message's outcome is saved: delete it. A claimed job has none (0): its
        publish was the acknowledgement. A database error is logged, never raised into
        django-q2's monitor: the message is handed out again after ``retry``."""
        if not task_id:
            return
        try:
            self.delete(task_id)
        except (DatabaseError, InterfaceError) as exc:
            log.warning("message %s: acknowledgement failed (%s)", task_id, type(exc).__name__)

    def fail(self, task_id: int) -> None:
        """The pusher could not read a message: delete it; no worker runs it."""
        _release(1, claimed=False)
        self.acknowledge(task_id)

    # --- the claim ----------------------------------------------------------------------

    def _idle(self) -> int:
        in_hand, _r, _w = _make_shared()
        now = time.monotonic()
        count = in_hand.value
        if count < self.capacity:
            self._full_since = (-1, 0.0)
            return self.capacity - count
        if self._full_since[0] != count:
            self._full_since = (count, now)
        elif now - self._full_since[1] > float(Conf.TIMEOUT or 0) + 5:
            # No task outlives django-q2's timeout: the workers that never said they were
            # done were killed in their task. Count again from nothing.
            log.warning("cluster: %d task(s) never reported done; counting workers again", count)
            with in_hand.get_lock():
                in_hand.value = 0
            self._full_since = (-1, 0.0)
            return self.capacity
        return 0

    def _fill(self, idle: int) -> list[tuple[int, str]]:
        tasks: list[tuple[int, str]] = []
        self.handed_early = False
        jobs_left, plain_left = not self._jobs_empty, not self._plain_empty
        while len(tasks) < idle and (jobs_left or plain_left):
            self._turn += 1
            # Contested slots alternate; a cluster woken from idle looks for a job first
            # (an enqueue's NOTIFY: one statement fewer before the job starts).
            first_job = self._turn % 2 or not self._busy
            order = ("job", "plain") if first_job else ("plain", "job")
            got = None
            for source in order:
                if source == "job" and jobs_left:
                    got = self._claim_one()
                    jobs_left = got is not None
                    self._jobs_empty = not jobs_left and self.remembers_empty
                elif source == "plain" and plain_left:
                    got = self._take_plain()
                    plain_left = got is not None
                    self._plain_empty = not plain_left and self.remembers_empty
                if got is not None:
                    break
            if got is not None:
                tasks.append(got)
                if not self._busy and len(tasks) < idle:
                    # Woken from idle: this one goes to a worker now; django-q2's pusher
                    # calls again at once for the other idle workers (two statements
                    # later, not before it).
                    self.handed_early = True
                    break
        if tasks:
            in_hand, _r, _w = _make_shared()
            with in_hand.get_lock():
                in_hand.value += len(tasks)
        return tasks

    def _claim_one(self) -> tuple[int, str] | None:
        """One claimed job as a package for a worker, or None when no queue has one."""
        from jobs.engine.job_machine import worker_identity

        # The cluster's claims are its pusher's: the owner its workers adopt.
        owner = worker_identity()
        claim = self._claimer.next(owner, busy=self._busy)
        return None if claim is None else self._package(claim, owner)

    def _package(self, claim, owner: str) -> tuple[int, str]:
        if isinstance(claim, Leased):
            effect = claim.effect
            task = {
                "id": uuid.uuid4().hex,
                "name": f"effect-{effect.pk}",
                "func": RELEASE_CLAIMED,
                "args": (effect.pk, owner, claim.prior),
                "kwargs": {"queues": self.queues},
                "started": timezone.now(),
                "save": False,
            }
            return 0, SignedPackage.dumps(task)
        job, attempt = claim.job, claim.attempt
        task = {
            "id": uuid.uuid4().hex,
            "name": f"job-{job.pk}",
            "func": RUN_CLAIMED,
            "args": (job.pk, job.lease_owner, attempt.pk, job.version),
            "kwargs": {"queues": self.queues},
            "started": timezone.now(),
            "save": False,
        }
        return 0, SignedPackage.dumps(task)


class ClaimingBroker(Claiming, PostgresBroker):
    """django-q2's broker over the jobs table on PostgreSQL: ``dequeue`` is the claim;
    plain messages as ``jobs.broker.PostgresBroker``'s; an idle pusher waits on LISTEN."""

    # Its wait hears everything that makes work due (a NOTIFY, a claimed task's end, a
    # due time): a look that found nothing is not repeated until one of them comes.
    remembers_empty = True

    def info(self) -> str:
        if not self._info:
            self._info = f"jobs table (claim) + PostgreSQL LISTEN/NOTIFY {self.connection}"
        return self._info

    def _take_plain(self) -> tuple[int, str] | None:
        params = {"keys": self.served, "bulk": 1, "retry": float(Conf.RETRY)}
        rows = self._execute(TAKE, params, fetch="all")
        return (rows[0][0], rows[0][1]) if rows else None

    # --- waiting ------------------------------------------------------------------------

    def _wait_for_work(self, due_in: float | bool | None = False) -> None:
        """Until a NOTIFY, a worker that finished, or the nearest due time (at most a
        heartbeat, ``broker_heartbeat``; ``poll`` when not listening). ``due_in``: the
        nearest due time just read (False: read it here)."""
        listening = self._ensure_listener()
        wait = heartbeat = float(_option("broker_heartbeat", HEARTBEAT))
        idle = self._idle() > 0
        if idle:
            if due_in is False:
                due_in = self._next_due()
            if due_in is not None and due_in <= 0:
                # Due and not claimed: a lease that ran out waits for its own verdict.
                self._claimer.look_now()
                wait = min(wait, 0.05)
            elif due_in is not None:
                wait = min(wait, due_in + 0.005)
        if not listening:
            wait = min(wait, float(Conf.POLL))
        _in_hand, r, _w = _make_shared()
        # A full cluster waits for a worker to finish, not for NOTIFYs: it could take no
        # job they announce (every release of a sequence's next job sends one: a wake a
        # job, for nothing). They are drained below and a freed worker looks anyway.
        fds = [r] + ([self._listener.fileno()] if listening and idle else [])
        try:
            ready, _, _ = select.select(fds, [], [], wait)
        except InterruptedError:
            return
        # Only the heartbeat ended the wait (a due time it waited for is not quiet).
        self._quiet_wake = listening and not ready and wait >= heartbeat
        ended = _drain(r) if r in ready else b""
        if not ready or len(ready) > 1 or r not in ready or ended.replace(PLAIN_ENDED, b""):
            # A NOTIFY, a due time, or a claimed job or send that ended (its publish may
            # have freed a tenant's slot or queued sends): look again. Only plain
            # messages that ended change nothing the last look saw.
            self._jobs_empty = self._plain_empty = False
        if listening:
            self._drain_notifications()

    def _next_due(self) -> float | None:
        from jobs.models import Effect, Job

        sql = _NEXT_JOB_DUE.format(t=Job._meta.db_table, q=TABLE, e=Effect._meta.db_table)
        params = {"queues": self.queues, "keys": self.served, "releases": self._claimer.releases}
        row = self._execute(sql, params, fetch="one")
        return None if row is None or row[0] is None else float(row[0])

    def _drain_notifications(self) -> None:
        try:
            for _note in self._listener.notifies(timeout=0):
                pass
        except Exception as exc:  # psycopg.Error: the listener is gone
            self._drop_listener(f"listener failed ({type(exc).__name__})")


# A worker's claimer per served queues (its own turn and its look for expired leases).
_claimers: dict[tuple[str, ...], Claimer] = {}


def keep_going(queues: list[str], owner: str, *, started: float, run) -> int:
    """A worker that finished a claimed job claims its queues' next due job itself and runs
    it (``run(claim)``), while ``JOBS_FOLLOW_ON_SECONDS`` from ``started`` lasts (cut to
    leave the longest kind its timeout before django-q2's alarm): a burst is not handed
    job by job through the pusher. Returns how many it ran. A database error stops it;
    the claim it may have made is reclaimed when its lease runs out."""
    from jobs.delivery.runner import follow_on_budget

    budget = follow_on_budget()
    if budget <= 0 or not queues:
        return 0
    claimer = _claimers.setdefault(tuple(queues), Claimer(queues))
    ran = 0
    try:
        while time.monotonic() - started < budget:
            claim = claimer.next(owner)
            if claim is None:
                break
            ran += 1
            if not run(claim):
                break
    except (DatabaseError, InterfaceError) as exc:
        log.warning("worker stopped claiming on (%s)", type(exc).__name__)
    return ran


def _option(name: str, default: Any) -> Any:
    from django.conf import settings

    return (getattr(settings, "Q_CLUSTER", None) or {}).get(name, default)


def _drain(fd: int) -> bytes:
    """Everything written to the wake pipe so far (a byte per ended task)."""
    read = b""
    try:
        while chunk := os.read(fd, 512):
            read += chunk
    except BlockingIOError:
        pass
    except OSError as exc:  # pragma: no cover - a closed pipe
        if exc.errno != errno.EBADF:
            raise
    return read


def _release(n: int, *, claimed: bool = True) -> None:
    """``n`` tasks ended: lower the count in hand and wake the pusher, saying whether a
    claimed job or send ended (``CLAIMED_ENDED``) or only a plain message."""
    if _shared is None:
        return
    in_hand, _r, w = _shared
    with in_hand.get_lock():
        in_hand.value = max(0, in_hand.value - n)
    with contextlib.suppress(OSError):  # the pipe is full: the pusher wakes anyway
        os.write(w, CLAIMED_ENDED if claimed else PLAIN_ENDED)


@receiver(post_execute_in_worker, dispatch_uid="jobs.claiming.task_done")
def _task_done(sender, task=None, **kwargs) -> None:
    """A worker finished a task the pusher handed it: one more idle worker."""
    if task is not None and not task.get("sync"):
        _release(1, claimed=task.get("func") in (RUN_CLAIMED, RELEASE_CLAIMED))
