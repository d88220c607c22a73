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
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.db import connection, transaction
from django.db.models import F
from django.db.models.functions import Coalesce, Now

from jobs import clock, conf, flow, rules, sql
from jobs.cas import compare_and_swap, mirror
from jobs.models import Attempt, Job, JobEvent

log = logging.getLogger("jobs.transitions")

State = Job.State
Outcome = Attempt.Outcome

_identity: tuple[int, str] | None = None


def worker_identity() -> str:
    """``host:pid:boot-nonce`` for this process; a forked child gets its own nonce."""
    global _identity
    pid = os.getpid()
    if _identity is None or _identity[0] != pid:
        _identity = (pid, f"{conf.host_name()}:{pid}:{uuid.uuid4().hex[:8]}")
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


def _lock_tenant(tenant_key: str) -> bool:
    """Serialize claims of one tenant so the concurrency bound holds under races.

    The same lock (``rules.TENANT_LOCK_CLASS``, the tenant's ``hashtext``) as
    ``jobs_tenant_admits_v2`` tries for the one-statement claim, so both paths take
    turns. Waits at most the worker transaction's lock timeout; False if it ran out.
    """
    return flow.lock(rules.TENANT_LOCK_CLASS, tenant_key)


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
        # ``flow_ruled``: an active flow rule on its kind or tenant (read in the same query).
        job = (
            Job.objects.annotate(db_now=Now(), flow_ruled=rules.flow_ruled_q())
            .filter(pk=job_id)
            .first()
        )
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

        live = rules.holds(rules.LIVE_RUNNING, job, now=now)
        early = rules.holds(rules.WAITING, job, now=now) and not rules.holds(
            rules.DUE, job, now=now
        )
        if job.is_terminal or live or early:
            _log(job, "duplicate_delivery", worker, state=job.state)
            return Claim("duplicate", job, record(Outcome.DUPLICATE_DELIVERY))

        reclaiming = job.state == State.RUNNING
        if not rules.holds(rules.HAS_BUDGET, job, now=now):
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

        if job.flow_ruled:
            # Pause, concurrency and rate of its kind and tenant (the tenant's bound too).
            hold = flow.admit_job(job, default_tenant_bound=conf.tenant_concurrency())
            if hold is not None:
                return _defer(job, worker, now, record, reclaiming, hold=hold)
        elif job.tenant_key:
            if not _lock_tenant(job.tenant_key):
                return _defer(job, worker, now, record, reclaiming)
            running = Job.objects.filter(
                rules.to_q(rules.LIVE_RUNNING), tenant_key=job.tenant_key
            ).exclude(pk=job.pk)
            if running.count() >= conf.tenant_concurrency():
                return _defer(job, worker, now, record, reclaiming)

        # The lease starts when the row is written (after the tenant's lock), by the
        # server's clock, as in the one-statement claim. SQLite: this transaction has
        # held the only write lock since its read, so nothing waited and ``now`` is it.
        postgres = connection.vendor == "postgresql"
        if not _cas(
            job,
            state=State.RUNNING,
            attempts=job.attempts + 1,
            lease_owner=worker,
            lease_expires_at=clock.after(lease) if postgres else now + timedelta(seconds=lease),
            next_attempt_at=None,
            started_at=job.started_at or now,
        ):
            _log(job, "duplicate_delivery", worker, reason="claim_race")
            return Claim("duplicate", job, record(Outcome.DUPLICATE_DELIVERY))
        if reclaiming:
            _close_open_attempts(job, now)
        started = now
        if postgres and (job.flow_ruled or job.tenant_key):
            # The claim may have waited for a lock: the attempt starts when its lease did
            # (read back from the row), so its record shows the bound exactly. A later
            # clock reading put the start, and so the lease it implies, tens of ms late
            # on a busy host, and a job claimed right after the lease ran out looked like
            # a breach of a tenant's concurrency 1 (seen in a soak).
            expires = Job.objects.values_list("lease_expires_at", flat=True).get(pk=job.pk)
            started = expires - timedelta(seconds=lease)
        attempt = Attempt.objects.create(
            job=job, number=job.attempts, worker=worker, started_at=started
        )
        _log(job, "claim", worker, reclaimed=reclaiming)
        return Claim("claimed", job, attempt)


def _close_open_attempts(job: Job, now) -> None:
    """The previous owner's lease expired without an outcome: presume it crashed."""
    Attempt.objects.filter(job=job, outcome="").update(outcome=Outcome.CRASHED, finished_at=now)


def _defer(job: Job, worker: str, now, record, reclaiming: bool, hold=None) -> Claim:
    """Tenant at its bound, or a flow rule holds the job (``hold``, a ``jobs.flow.Hold``):
    push the due time (jittered), spend no attempt."""
    if hold is None:
        delay = float(conf.get("JOBS_TENANT_DEFER_SECONDS")) * (1 + random.random())
    else:
        delay = hold.delay
    due = now + timedelta(seconds=delay)
    changes = {"next_attempt_at": due, "enqueued_for": None}
    if reclaiming:
        changes.update(state=State.RETRY_WAIT, lease_expires_at=None)
    if not _cas(job, **changes):
        return Claim("duplicate", job, record(Outcome.DUPLICATE_DELIVERY))
    if reclaiming:
        _close_open_attempts(job, now)
    if hold is None:
        _log(job, "defer", worker, tenant=job.tenant_key)
        return Claim("deferred", job, record(Outcome.DEFERRED))
    _log(job, "defer", worker, scope=hold.scope, reason=hold.reason, delay=f"{delay:.2f}")
    return Claim("deferred", job, record(Outcome.DEFERRED, error_code=hold.code))


def heartbeat(job: Job, worker: str, *, lease_seconds: float | None = None) -> bool:
    """Extend our lease; False when the job is no longer ours."""
    lease = conf.lease_seconds() if lease_seconds is None else lease_seconds
    return _cas(job, owner=worker, state=State.RUNNING, lease_expires_at=clock.after(lease))


def still_owner(job: Job, worker: str) -> bool:
    """Whether ``worker`` still holds the job, at the version it last wrote, on a live lease."""
    if sql.available():
        return sql.still_owner(job, worker)
    fence = rules.to_q(rules.STILL_OWNER, job=job.pk, version=job.version, worker=worker, margin=0)
    return Job.objects.filter(fence).exists()


def publish_changes() -> dict:
    """What running → succeeded writes besides the version (one list for both paths)."""
    return {
        "state": State.SUCCEEDED,
        "lease_expires_at": None,
        "finished_at": Now(),
        "last_error_class": "",
        "last_error_code": "",
        "last_error_detail": "",
        "last_error_type": "",
        "last_error_message": "",
        "last_error_traceback": "",
        "outage_since": None,
    }


def publish(job: Job, worker: str, *, margin: float | None = None) -> bool:
    """running → succeeded; call inside the transaction that records the effects.

    The lease must outlast the transaction's idle timeout, so this transaction can
    only commit while the lease still holds (``clock.worker_transaction``). The
    one-statement publish (``jobs.sql.publish``) writes the same arrow from the
    same ``publish_changes`` and the same fence.
    """
    margin = conf.transaction_idle_seconds() if margin is None else margin
    won = _cas(job, owner=worker, margin=margin, **publish_changes())
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
    **error: str,
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
        **error,  # last_error_type/_message/_traceback (jobs.failures), when known
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


def _finish(
    job: Job, worker: str, state: str, error_class: str, code: str, detail: str, **error: str
) -> bool:
    won = _cas(
        job,
        owner=worker,
        state=state,
        lease_expires_at=None,
        finished_at=Now(),
        last_error_class=error_class,
        last_error_code=code,
        last_error_detail=detail[:300],
        **error,
    )
    if won:
        _log(job, state, worker, error_class=error_class, code=code)
    return won


def fail(
    job: Job, worker: str, *, error_class: str, code: str, detail: str = "", **error: str
) -> bool:
    """running → failed: a permanent error, no retry."""
    return _finish(job, worker, State.FAILED, error_class, code, detail, **error)


def bury(
    job: Job, worker: str, *, error_class: str, code: str, detail: str = "", **error: str
) -> bool:
    """running → dead: retries exhausted, for operator review."""
    return _finish(job, worker, State.DEAD, error_class, code, detail, **error)


def _operator(job: Job, action: str, actor: str, note: str, **changes) -> bool:
    """An operator's arrow: the CAS and its history row commit together (invariant 10)."""
    before = job.state
    with transaction.atomic():
        if not _cas(job, **changes):
            return False
        JobEvent.objects.create(
            job=job,
            action=action,
            actor=actor[:200],
            from_state=before,
            to_state=job.state,
            version=job.version,
            note=note[:300],
        )
    _log(job, action, actor)
    return True


def cancel(job: Job, *, actor: str = "operator", note: str = "") -> bool:
    """Operator: queued/retry_wait → cancelled."""
    if job.state not in (State.QUEUED, State.RETRY_WAIT):
        return False
    return _operator(job, "cancel", actor, note, state=State.CANCELLED, finished_at=Now())


def requeue(job: Job, *, actor: str = "operator", note: str = "") -> bool:
    """Operator: failed/dead → queued with a fresh attempt budget.

    The budget grows instead of the count going back to 0: attempt numbers of one
    job never repeat, and the history reads in order.
    """
    if job.state not in (State.FAILED, State.DEAD):
        return False
    from jobs import registry
    from jobs.exceptions import UnknownKind

    try:
        budget = registry.get_kind(job.kind).max_attempts or conf.max_attempts()
    except UnknownKind:
        budget = conf.max_attempts()
    return _operator(
        job,
        "requeue",
        actor,
        note,
        state=State.QUEUED,
        max_attempts=job.attempts + budget,
        next_attempt_at=Now(),
        enqueued_for=None,
        finished_at=None,
        lease_expires_at=None,
    )


def retry_now(job: Job, *, actor: str = "operator", note: str = "") -> bool:
    """Operator: make a waiting job due at once."""
    if job.state not in (State.QUEUED, State.RETRY_WAIT):
        return False
    return _operator(job, "retry_now", actor, note, next_attempt_at=Now(), enqueued_for=None)


def finish_attempt(attempt: Attempt, outcome: str, **fields) -> None:
    """Record how a delivery ended (attempts are history, not state: no CAS needed)."""
    fields.setdefault("finished_at", Now())
    for name, value in fields.items():
        if not hasattr(value, "resolve_expression"):
            setattr(attempt, name, value)
    attempt.outcome = outcome
    Attempt.objects.filter(pk=attempt.pk).update(outcome=outcome, **fields)
