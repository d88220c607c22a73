"""The only writer of ``Job.state``: one compare-and-swap UPDATE per arrow.

Each function names the version it read in the WHERE clause (and the lease
owner where it matters) and returns whether it won. Zero rows updated means
another worker or an operator moved the job first; the caller must then do
nothing more for that job.

    queued ──claim──▶ running ──publish──▶ succeeded
    retry_wait ─(due)─claim──▶ running ──schedule_retry──▶ retry_wait
    running ──heartbeat/progress──▶ running running ──fail──▶ failed
    running (expired) ──claim──▶ running    running ──bury──▶ dead
    queued/retry_wait ──cancel──▶ cancelled failed/dead ──requeue──▶ queued
    queued/retry_wait/dead ──fail_by_operator──▶ failed
    running ──cancel (requested)──▶ running ──stop_cancelled──▶ cancelled
"""

from __future__ import annotations

import logging
import os
import uuid
from datetime import timedelta

from django.db import connection, transaction
from django.db.models import F, QuerySet
from django.db.models.functions import Coalesce, Now

from jobs import clock, conf, queue, registry, rules
from jobs.engine import groups
from jobs.engine.cas import compare_and_swap, mirror
from jobs.engine.plan import Hold
from jobs.exceptions import UnknownKind
from jobs.models import Attempt, Job, JobEvent, JobGroup

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


def log_arrow(job: Job, arrow: str, worker: str = "", **extra) -> None:
    """One line per transition: ids, classes and codes only, never params or payload."""
    fields = {"job": job.pk, "kind": job.kind, "arrow": arrow, "attempt": job.attempts}
    fields.update(worker=worker, **extra)
    log.info(" ".join(f"{k}={v}" for k, v in fields.items()), extra=fields)


def start(job: Job, worker: str, *, lease: float, now) -> bool:
    """queued, due retry_wait or expired running → running: the claim's arrow.

    The lease starts when the row is written, by the server's clock (on SQLite the
    claim's transaction has held the only write lock since its read, so ``now`` is it).
    """
    postgres = connection.vendor == "postgresql"
    return _cas(
        job,
        state=State.RUNNING,
        attempts=job.attempts + 1,
        lease_owner=worker,
        lease_expires_at=clock.after(lease) if postgres else now + timedelta(seconds=lease),
        next_attempt_at=None,
        started_at=job.started_at or now,
        held_by="",  # admitted: no paused scope holds it any more
        deferred_by="",  # nor a rule's deferral
    )


def bury_spent(job: Job, *, now, reclaiming: bool) -> tuple[bool, str, str]:
    """queued/retry_wait/expired running → dead: the attempt budget is spent (crashes
    count), so the claim stops here instead of looping. Returns (won, class, code)."""
    error_class = "unknown" if reclaiming else (job.last_error_class or "unknown")
    code = "crashed" if reclaiming else "max_attempts"
    won = _cas(
        job,
        state=State.DEAD,
        lease_expires_at=None,
        finished_at=now,
        last_error_class=error_class,
        last_error_code=code,
        last_error_detail="attempt budget spent",
    )
    if won:
        close_open_attempts(job, now)
        log_arrow(job, "bury", "", error_class=error_class, code=code)
        groups.child_ended(job, State.DEAD)
    return won, error_class, code


def defer(job: Job, worker: str, *, now, hold: Hold, reclaiming: bool) -> bool:
    """A flow rule or the tenant's bound holds the job: push its due time, spend no attempt
    (an expired running job goes back to retry_wait). A paused scope holds it instead
    (``held_by``), its due time kept: it waits out of the claim's way until the scope is
    resumed (``jobs.flow.release``), then takes its place in the queue again."""
    # Each look that holds it back is counted on the job, not written as an attempt row.
    changes = {"held_looks": job.held_looks + 1}  # the swap's version makes it exact
    if hold.reason == "paused":
        changes["held_by"] = hold.scope[:200]
    else:
        # The scope is kept until the job starts: deleting or loosening its rule makes the
        # job due at once (``jobs.engine.held.release_deferred``).
        changes.update(
            next_attempt_at=now + timedelta(seconds=hold.delay), deferred_by=hold.scope[:200]
        )
    if reclaiming:
        changes.update(state=State.RETRY_WAIT, lease_expires_at=None)
    # Only a job still waiting (or, reclaimed, still running on a lease that ran out) is
    # held back: a deferral never lands on a job another claim has started meanwhile.
    still = rules.to_q(rules.JOB_LEASE_EXPIRED if reclaiming else rules.WAITING)
    if not _cas(job, where=still, **changes):
        return False
    if reclaiming:
        close_open_attempts(job, now)
    log_arrow(job, "defer", worker, scope=hold.scope, reason=hold.reason, delay=f"{hold.delay:.2f}")
    return True


def close_open_attempts(job: Job, now) -> None:
    """The previous owner's lease expired without an outcome: presume it crashed."""
    Attempt.objects.filter(job=job, outcome="").update(outcome=Outcome.CRASHED, finished_at=now)


def heartbeat(job: Job, worker: str, *, lease_seconds: float | None = None) -> bool:
    """Extend our lease; False when the job is no longer ours."""
    lease = conf.lease_seconds() if lease_seconds is None else lease_seconds
    return _cas(job, owner=worker, state=State.RUNNING, lease_expires_at=clock.after(lease))


def progress(
    job: Job,
    worker: str,
    *,
    done: int,
    total: int | None,
    note: str,
    lease_seconds: float | None = None,
) -> bool:
    """Store the handler's progress, fenced like a heartbeat (and one: the lease is
    extended by the same write); False when the job is no longer ours."""
    lease = conf.lease_seconds() if lease_seconds is None else lease_seconds
    return _cas(
        job,
        owner=worker,
        state=State.RUNNING,
        lease_expires_at=clock.after(lease),
        progress_done=done,
        progress_total=total,
        progress_note=note,
        progress_at=Now(),
    )


def still_owner(job: Job, worker: str) -> bool:
    """Whether ``worker`` still holds the job, at the version it last wrote, on a live lease
    (the ORM's reading; ``jobs.executors.postgres`` has the same rule in one statement)."""
    return owner_holds(job, worker).exists()


def owner_holds(job: Job, worker: str) -> QuerySet[Job]:
    """The job's row while ``worker`` still holds it (``rules.STILL_OWNER``), else no row:
    as ``Exists`` inside a private read, the check and the read share one snapshot."""
    fence = rules.to_q(rules.STILL_OWNER, job=job.pk, version=job.version, worker=worker, margin=0)
    return Job.objects.filter(fence)


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


def publish(
    job: Job, worker: str, *, margin: float | None = None, changes: dict | None = None
) -> bool:
    """running → succeeded; call inside the transaction that records the effects.

    The lease must outlast the transaction's idle timeout, so this transaction can
    only commit while the lease still holds (``clock.worker_transaction``). The
    one-statement publish (``jobs.executors.postgres.publish``) writes the same arrow from the
    same ``publish_changes`` and the same fence.
    """
    margin = conf.transaction_idle_seconds() if margin is None else margin
    won = _cas(job, owner=worker, margin=margin, **(changes or publish_changes()))
    if won:
        log_arrow(job, "publish", worker)
        groups.child_ended(job, State.SUCCEEDED)
    return won


def mirror_publish(job: Job, worker: str) -> None:
    """After the one-statement publish won: the instance as the CAS would leave it."""
    mirror(job, publish_changes())
    log_arrow(job, "publish", worker)


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
        log_arrow(
            job,
            "retry",
            worker,
            error_class=error_class,
            code=code,
            delay=f"{delay:.2f}",
            outage=outage,
        )
        # Idle clusters learn the new due time when this arrow commits.
        queue.enqueue_jobs([job], due_now=False)
    return won


def wake_outage_waiters(code: str, worker: str) -> int:
    """retry_wait → due now for the jobs backing off from an outage with ``code`` (a
    dependency that is back, because a job that met it just succeeded); their budgets and
    outage starts are kept. Wakes the clusters serving them when this commits."""
    waiting = Job.objects.filter(
        state=State.RETRY_WAIT,
        outage_since__isnull=False,
        last_error_code=code,
        next_attempt_at__gt=Now(),
    )
    queues = sorted(set(waiting.values_list("queue", flat=True)))
    woken = waiting.update(next_attempt_at=Now(), updated_at=Now())
    if woken:
        log.info("outage over code=%s woken=%s by worker=%s", code, woken, worker)
        queue.notify_queues(queues)
    return woken


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
        log_arrow(job, state, worker, error_class=error_class, code=code)
        groups.child_ended(job, state)
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
    log_arrow(job, action, actor)
    return True


def cancel(job: Job, *, actor: str = "operator", note: str = "") -> bool:
    """Operator: queued/retry_wait → cancelled; running → cancel requested.

    A running job is not stopped from outside: the request is one more swap on its
    version, so every fenced write of its worker (heartbeat, owner check, publish) fails
    from here on, and the worker (or, if it is gone, the next claim) ends it cancelled
    (``stop_cancelled``). False when the job is finished (nothing changes) or the
    request was already made.
    """
    if job.state not in rules.OPERATOR_SOURCES["cancel"]:
        return False
    if job.state == State.RUNNING:
        if job.cancel_requested_at is not None:
            return False
        return _operator(
            job,
            "cancel_requested",
            actor,
            note,
            cancel_requested_at=Now(),
            cancel_requested_by=actor[:200],
        )
    with transaction.atomic():
        won = _operator(job, "cancel", actor, note, state=State.CANCELLED, finished_at=Now())
        if won:
            groups.child_ended(job, State.CANCELLED)
    return won


def cancel_follow_ups(job: Job, *, actor: str = "operator") -> int:
    """Operator: cancel the follow-ups of a finished ``job`` (and theirs) that are not
    running, and mark its groups so their joins do not run; returns how many it cancelled.

    Each cancel is its own transaction (a lock is never held while another child's is
    waited for). A running follow-up is left to finish; one already ended stays as it is.
    """
    cancelled, parents = 0, [job.pk]
    note = f"its parent job {job.pk} was cancelled"
    while parents:
        JobGroup.objects.filter(parent_id__in=parents, cancelled_at__isnull=True).update(
            cancelled_at=Now()
        )
        follow_ups = list(Job.objects.filter(parent_id__in=parents).order_by("pk"))
        for follow_up in follow_ups:
            if rules.holds(rules.WAITING, follow_up, now=None):  # not running, not ended
                cancelled += cancel(follow_up, actor=actor, note=note)
        parents = [f.pk for f in follow_ups]
    return cancelled


def stop_cancelled(job_id: int, worker: str) -> bool:
    """running (cancel requested) → cancelled, by the worker that stopped or by the claim
    that found its owner gone; its open attempts end ``cancelled``."""
    job = Job.objects.filter(rules.to_q(rules.CANCEL_REQUESTED), pk=job_id).first()
    if job is None:
        return False
    with transaction.atomic():
        won = _cas(
            job,
            state=State.CANCELLED,
            lease_expires_at=None,
            finished_at=Now(),
            last_error_class="",
            last_error_code="cancelled",
            last_error_detail=f"cancelled at the request of {job.cancel_requested_by}"[:300],
        )
        if won:
            Attempt.objects.filter(job=job, outcome="").update(
                outcome=Outcome.CANCELLED, finished_at=Now()
            )
            groups.child_ended(job, State.CANCELLED)
    if won:
        log_arrow(job, "cancelled", worker, requested_by=job.cancel_requested_by)
    return won


def requeue(job: Job, *, actor: str = "operator", note: str = "") -> bool:
    """Operator: failed/dead → queued with a fresh attempt budget.

    The budget grows instead of the count going back to 0: attempt numbers of one
    job never repeat, and the history reads in order.
    """
    if job.state not in rules.OPERATOR_SOURCES["requeue"]:
        return False
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
        finished_at=None,
        lease_expires_at=None,
        # Out of its debounce window for good (docs/app/debounce.md): one failed before
        # its first claim would otherwise reopen a window its key may have again.
        debounce_key="",
    )


def release_sequence(job: Job, *, actor: str = "operator", note: str = "") -> bool:
    """Operator: a failed or dead job holding its sequence lets it go on (its state stays;
    docs/app/sequences.md). False when it holds none (or another operator acted first)."""
    if not job.sequence_key or not rules.holds(rules.SEQUENCE_HOLDING, job, now=None):
        return False
    return _operator(job, "release_sequence", actor, note, sequence_released_by=actor[:200])


def fail_by_operator(job: Job, *, actor: str, reason: str) -> bool:
    """Operator: queued/retry_wait/dead → failed, never tried again, ``reason`` recorded.

    For a job nothing can help (its own parameters are the cause: no fix of its subject
    and no requeue makes it run otherwise). The reason is the history row's note (the
    operator's words; the transition's log line names the arrow, never the note). Its
    error class and code stay what the last attempt found, so the cause still reads as
    it did; a group child's end is counted (once: a dead child counted already).
    """
    if not reason.strip():
        raise ValueError("failing a job needs the reason")
    if job.state not in rules.OPERATOR_SOURCES["fail"]:
        return False
    with transaction.atomic():
        won = _operator(
            job,
            "fail",
            actor,
            reason.strip(),
            state=State.FAILED,
            finished_at=Now(),
            lease_expires_at=None,
        )
        if won:
            groups.child_ended(job, State.FAILED)
    return won


def retry_now(job: Job, *, actor: str = "operator", note: str = "") -> bool:
    """Operator: make a waiting job due at once."""
    if job.state not in rules.OPERATOR_SOURCES["retry_now"]:
        return False
    return _operator(job, "retry_now", actor, note, next_attempt_at=Now())


def finish_attempt(attempt: Attempt, outcome: str, **fields) -> None:
    """Record how a delivery ended (attempts are history, not state: no CAS needed)."""
    fields.setdefault("finished_at", Now())
    for name, value in fields.items():
        if not hasattr(value, "resolve_expression"):
            setattr(attempt, name, value)
    attempt.outcome = outcome
    Attempt.objects.filter(pk=attempt.pk).update(outcome=outcome, **fields)
