"""The only writer of ``Job.state``: one compare-and-swap UPDATE per arrow.

Each function names the version it read in the WHERE clause (and the lease
owner where it matters) and returns whether it won. Zero rows updated means
another worker or an operator moved the job first; the caller must then do
nothing more for that job.

    queued ──claim──▶ running ──publish──▶ succeeded
    retry_wait ─(due)─claim──▶ running ──schedule_retry──▶ retry_wait
    running ──heartbeat──▶ running          running ──fail──▶ failed
    running (expired) ──claim──▶ running    running ──bury──▶ dead
    queued/retry_wait ──cancel──▶ cancelled failed/dead ──requeue──▶ queued
"""

from __future__ import annotations

import logging
import os
import random
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.db import connection
from django.db.models import F
from django.db.models.functions import Coalesce, Now

from jobs import clock, conf, sql
from jobs.cas import compare_and_swap, mirror
from jobs.models import Attempt, Job

log = logging.getLogger("jobs.transitions")

State = Job.State
Outcome = Attempt.Outcome

_identity: tuple[int, str] | None = None


def worker_identity() -> str:
    """``host:pid:boot-nonce`` for this process; a forked child gets its own nonce."""
    global _identity
    pid = os.getpid()
    if _identity is None or _identity[0] != pid:
        _identity = (pid, f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex[:8]}")
    return _identity[1]


_cas = compare_and_swap


def _log(job: Job, arrow: str, worker: str = "", **extra) -> None:
    """One line per transition: ids, classes and codes only, never params or payload."""
    fields = {"job": job.pk, "kind": job.kind, "arrow": arrow, "attempt": job.attempts}
    fields.update(worker=worker, **extra)
    log.info(" ".join(f"{k}={v}" for k, v in fields.items()), extra=fields)


@dataclass
class Claim:
    """What a delivery found: ``claimed`` (work to do) or why there is none."""

    status: str  # claimed | duplicate | deferred | buried | missing
    job: Job | None = None
    attempt: Attempt | None = None

    @property
    def won(self) -> bool:
        return self.status == "claimed"


def _lock_tenant(tenant_key: str) -> None:
    """Serialize claims of one tenant so the concurrency bound holds under races.

    The same lock (class ``jobs``, the tenant's ``hashtext``) as ``jobs_tenant_admits``
    takes for the one-statement claim, so both paths take turns.
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(1785684595, hashtext(%s))", [tenant_key])
    # SQLite: transaction_mode=IMMEDIATE already serializes every writing transaction.


def claim(job_id: int, worker: str, *, lease_seconds: float | None = None) -> Claim:
    """Take the job for ``worker``: queued, due retry_wait or expired running → running.

    Records the delivery as an Attempt whatever happens, so deliveries and
    duplicate deliveries can be counted apart.
    """
    lease = conf.lease_seconds() if lease_seconds is None else lease_seconds
    if sql.available():
        # The common case in one statement; anything else is decided (and recorded) below.
        claimed = sql.claim(
            job_id,
            worker,
            lease=lease,
            bound=conf.tenant_concurrency(),
        )
        if claimed is not None:
            job, attempt = claimed
            _log(job, "claim", worker, reclaimed=False)
            return Claim("claimed", job, attempt)
    with clock.worker_transaction():
        # The server's clock, read with the row: every decision and write below uses it.
        job = Job.objects.annotate(db_now=Now()).filter(pk=job_id).first()
        if job is None:
            log.warning("job=%s delivery for a job that does not exist", job_id)
            return Claim("missing")
        now = job.db_now

        def record(outcome: str, **fields) -> Attempt:
            return Attempt.objects.create(
                job=job,
                number=fields.pop("number", 0),
                worker=worker,
                started_at=now,
                finished_at=fields.pop("finished_at", now),
                outcome=outcome,
                **fields,
            )

        live = job.state == State.RUNNING and job.lease_expires_at and job.lease_expires_at > now
        early = (
            job.state in (State.QUEUED, State.RETRY_WAIT)
            and job.next_attempt_at is not None
            and job.next_attempt_at > now
        )
        if job.is_terminal or live or early:
            _log(job, "duplicate_delivery", worker, state=job.state)
            return Claim("duplicate", job, record(Outcome.DUPLICATE_DELIVERY))

        reclaiming = job.state == State.RUNNING
        if job.attempts >= job.max_attempts:
            # The budget is spent (crashes count): stop here instead of looping.
            error_class = "unknown" if reclaiming else (job.last_error_class or "unknown")
            code = "crashed" if reclaiming else "max_attempts"
            if not _cas(
                job,
                state=State.DEAD,
                lease_expires_at=None,
                finished_at=now,
                last_error_class=error_class,
                last_error_code=code,
                last_error_detail="attempt budget spent",
            ):
                return Claim("duplicate", job, record(Outcome.DUPLICATE_DELIVERY))
            _close_open_attempts(job, now)
            _log(job, "bury", worker, error_class=error_class, code=code)
            return Claim(
                "buried", job, record(Outcome.DEAD, error_class=error_class, error_code=code)
            )

        if job.tenant_key:
            _lock_tenant(job.tenant_key)
            running = (
                Job.objects.live_running(now).filter(tenant_key=job.tenant_key).exclude(pk=job.pk)
            )
            if running.count() >= conf.tenant_concurrency():
                return _defer(job, worker, now, record, reclaiming)

        if not _cas(
            job,
            state=State.RUNNING,
            attempts=job.attempts + 1,
            lease_owner=worker,
            lease_expires_at=now + timedelta(seconds=lease),
            next_attempt_at=None,
            started_at=job.started_at or now,
        ):
            _log(job, "duplicate_delivery", worker, reason="claim_race")
            return Claim("duplicate", job, record(Outcome.DUPLICATE_DELIVERY))
        if reclaiming:
            _close_open_attempts(job, now)
        attempt = Attempt.objects.create(
            job=job, number=job.attempts, worker=worker, started_at=now
        )
        _log(job, "claim", worker, reclaimed=reclaiming)
        return Claim("claimed", job, attempt)


def _close_open_attempts(job: Job, now) -> None:
    """The previous owner's lease expired without an outcome: presume it crashed."""
    Attempt.objects.filter(job=job, outcome="").update(outcome=Outcome.CRASHED, finished_at=now)


def _defer(job: Job, worker: str, now, record, reclaiming: bool) -> Claim:
    """Tenant at its bound: push the due time a little, spend no attempt."""
    delay = float(conf.get("JOBS_TENANT_DEFER_SECONDS")) * (1 + random.random())
    due = now + timedelta(seconds=delay)
    changes = {"next_attempt_at": due, "enqueued_for": None}
    if reclaiming:
        changes.update(state=State.RETRY_WAIT, lease_expires_at=None)
    if not _cas(job, **changes):
        return Claim("duplicate", job, record(Outcome.DUPLICATE_DELIVERY))
    if reclaiming:
        _close_open_attempts(job, now)
    _log(job, "defer", worker, tenant=job.tenant_key)
    return Claim("deferred", job, record(Outcome.DEFERRED))


def heartbeat(job: Job, worker: str, *, lease_seconds: float | None = None) -> bool:
    """Extend our lease; False when the job is no longer ours."""
    lease = conf.lease_seconds() if lease_seconds is None else lease_seconds
    return _cas(job, owner=worker, state=State.RUNNING, lease_expires_at=clock.after(lease))


def still_owner(job: Job, worker: str) -> bool:
    """Whether ``worker`` still holds the job, at the version it last wrote, on a live lease."""
    if sql.available():
        return sql.still_owner(job, worker)
    return Job.objects.filter(
        pk=job.pk,
        version=job.version,
        lease_owner=worker,
        state=State.RUNNING,
        lease_expires_at__gt=Now(),
    ).exists()


def publish_changes() -> dict:
    """What running → succeeded writes besides the version (one list for both paths)."""
    return {
        "state": State.SUCCEEDED,
        "lease_expires_at": None,
        "finished_at": Now(),
        "last_error_class": "",
        "last_error_code": "",
        "last_error_detail": "",
        "outage_since": None,
    }


def publish(job: Job, worker: str) -> bool:
    """running → succeeded; call inside the transaction that records the effects.

    The lease must outlast the transaction's idle timeout, so this transaction can
    only commit while the lease still holds (``clock.worker_transaction``). The
    one-statement publish (``jobs.sql.publish``) writes the same arrow.
    """
    won = _cas(job, owner=worker, margin=conf.transaction_idle_seconds(), **publish_changes())
    if won:
        _log(job, "publish", worker)
    return won


def mirror_publish(job: Job, worker: str) -> None:
    """After the one-statement publish won: the instance as the CAS would leave it."""
    mirror(job, publish_changes())
    _log(job, "publish", worker)


def schedule_retry(
    job: Job,
    worker: str,
    *,
    delay: float,
    error_class: str,
    code: str,
    detail: str = "",
    outage: bool = False,
) -> bool:
    """running → retry_wait, due after ``delay`` seconds.

    ``outage``: a dependency is down; the budget grows by the attempt this claim
    cost (the retry table decides while the outage window lasts), and the
    outage's start is kept, so the window is measured from it.
    """
    changes = {"outage_since": None}
    if outage:
        changes = {
            "max_attempts": F("max_attempts") + 1,
            "outage_since": Coalesce("outage_since", Now()),
        }
    won = _cas(
        job,
        owner=worker,
        state=State.RETRY_WAIT,
        lease_expires_at=None,
        next_attempt_at=clock.after(delay),
        last_error_class=error_class,
        last_error_code=code,
        last_error_detail=detail[:300],
        **changes,
    )
    if won:
        _log(
            job,
            "retry",
            worker,
            error_class=error_class,
            code=code,
            delay=f"{delay:.2f}",
            outage=outage,
        )
    return won


def _finish(job: Job, worker: str, state: str, error_class: str, code: str, detail: str) -> bool:
    won = _cas(
        job,
        owner=worker,
        state=state,
        lease_expires_at=None,
        finished_at=Now(),
        last_error_class=error_class,
        last_error_code=code,
        last_error_detail=detail[:300],
    )
    if won:
        _log(job, state, worker, error_class=error_class, code=code)
    return won


def fail(job: Job, worker: str, *, error_class: str, code: str, detail: str = "") -> bool:
    """running → failed: a permanent error, no retry."""
    return _finish(job, worker, State.FAILED, error_class, code, detail)


def bury(job: Job, worker: str, *, error_class: str, code: str, detail: str = "") -> bool:
    """running → dead: retries exhausted, for operator review."""
    return _finish(job, worker, State.DEAD, error_class, code, detail)


def cancel(job: Job) -> bool:
    """Operator: queued/retry_wait → cancelled."""
    if job.state not in (State.QUEUED, State.RETRY_WAIT):
        return False
    won = _cas(job, state=State.CANCELLED, finished_at=Now())
    if won:
        _log(job, "cancel", "operator")
    return won


def requeue(job: Job) -> bool:
    """Operator: failed/dead → queued with a fresh attempt budget."""
    if job.state not in (State.FAILED, State.DEAD):
        return False
    won = _cas(
        job,
        state=State.QUEUED,
        attempts=0,
        next_attempt_at=Now(),
        enqueued_for=None,
        finished_at=None,
        lease_expires_at=None,
    )
    if won:
        _log(job, "requeue", "operator")
    return won


def retry_now(job: Job) -> bool:
    """Operator: make a waiting job due at once."""
    if job.state not in (State.QUEUED, State.RETRY_WAIT):
        return False
    return _cas(job, next_attempt_at=Now(), enqueued_for=None)


def finish_attempt(attempt: Attempt, outcome: str, **fields) -> None:
    """Record how a delivery ended (attempts are history, not state: no CAS needed)."""
    fields.setdefault("finished_at", Now())
    for name, value in fields.items():
        if not hasattr(value, "resolve_expression"):
            setattr(attempt, name, value)
    attempt.outcome = outcome
    Attempt.objects.filter(pk=attempt.pk).update(outcome=outcome, **fields)
