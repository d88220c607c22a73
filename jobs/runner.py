"""One delivery of one job: claim → produce → publish (external effects get their own message).

Returns only after every outcome is committed, so django-q2 acknowledges the
message only then. A worker that lost its lease publishes nothing; a second
delivery of a finished job is recorded and otherwise ignored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

from django.db import DatabaseError, connection, transaction

from jobs import artifacts, clock, conf, ledger, queue, registry, sql, transitions
from jobs.exceptions import LeaseLost
from jobs.models import Artifact, Attempt, Job
from jobs.retry import classify, job_outcome

log = logging.getLogger("jobs.runner")

Outcome = Attempt.Outcome
StageHook = Callable[[str, "JobContext"], None]


class JobContext:
    """What a handler gets: the job, its fence, and the artifact store."""

    def __init__(self, job: Job, worker: str, attempt: Attempt, on_stage: StageHook | None):
        self.job = job
        self.worker = worker
        self.attempt = attempt
        self.artifact: Artifact | None = None
        self._on_stage = on_stage
        self._lease_extended_at = time.monotonic()  # the claim just set a full lease
        self._owner_checked = False

    @property
    def params(self) -> dict:
        return self.job.params

    def stage(self, name: str) -> None:
        """Mark a stage; test hooks and drills pause or fail here."""
        if self._on_stage is not None:
            self._on_stage(name, self)

    def check_owner(self) -> None:
        """Raise LeaseLost unless this worker still holds the job; call before private reads."""
        if not transitions.still_owner(self.job, self.worker):
            raise LeaseLost(f"job {self.job.pk} is no longer held by this worker")
        self._owner_checked = True

    def heartbeat(self) -> None:
        """Extend the lease between stages of healthy work; raise LeaseLost if it is gone.

        A lease less than a third spent is left alone: the write would buy nothing,
        and the publish CAS fences a worker that lost its job anyway.
        """
        if time.monotonic() - self._lease_extended_at < conf.lease_seconds() / 3:
            return
        if not transitions.heartbeat(self.job, self.worker):
            raise LeaseLost(f"job {self.job.pk} was reclaimed before the heartbeat")
        self._lease_extended_at = time.monotonic()

    def store_artifact(self, data: bytes, *, content_type: str, extension: str) -> Artifact:
        """Store (or verify) the job's one artifact file; its row commits with the publish.

        Ownership is checked here only if the handler has not checked it yet: the
        file goes under the job's own key, and the publish CAS fences the row.
        """
        if not self._owner_checked:
            self.check_owner()
        stored = artifacts.store(self.job, data, content_type=content_type, extension=extension)
        self.artifact = stored.artifact
        self.stage("artifact_stored")
        return stored.artifact


@dataclass
class DeliveryResult:
    job_id: int
    outcome: str
    worker: str
    effects: dict[str, str] = field(default_factory=dict)


def run_delivery(
    job_id: int, *, worker: str | None = None, on_stage: StageHook | None = None
) -> DeliveryResult:
    """Handle one queue delivery of ``job_id`` by the worker protocol in DESIGN.md."""
    worker = worker or transitions.worker_identity()
    claim = transitions.claim(job_id, worker)
    if not claim.won:
        return DeliveryResult(job_id, claim.status, worker)
    job, attempt = claim.job, claim.attempt
    ctx = JobContext(job, worker, attempt, on_stage)
    ctx.stage("claimed")
    try:
        kind = registry.get_kind(job.kind)
        specs = registry.validate_effects(kind.handler(ctx) or [])
        ctx.stage("before_publish")
        ctx.heartbeat()  # a lease more than a third spent is extended before the fenced publish
    except LeaseLost:
        transitions.finish_attempt(attempt, Outcome.LEASE_LOST)
        log.info("job=%s worker=%s lease lost during work", job.pk, worker)
        return DeliveryResult(job_id, Outcome.LEASE_LOST, worker)
    except Exception as exc:  # the retry table decides what this means
        return _handle_failure(ctx, exc)

    effects = _publish(ctx, specs)
    if effects is None:
        transitions.finish_attempt(attempt, Outcome.LEASE_LOST)
        log.info("job=%s worker=%s publish lost: another worker owns the job", job.pk, worker)
        return DeliveryResult(job_id, Outcome.LEASE_LOST, worker)
    ctx.stage("published")
    return DeliveryResult(
        job_id, Outcome.SUCCEEDED, worker, {e.effect_id: e.state for e in effects}
    )


def _publish(ctx: JobContext, specs: list) -> list | None:
    """running → succeeded with the artifact row, the effects and the attempt's outcome.

    One statement when it can (PostgreSQL, effects born final in-app: ``jobs.sql``),
    else one ORM transaction that also enqueues the external effects' messages.
    Returns the effects, or None when the CAS lost (nothing was written).
    """
    job, worker, attempt = ctx.job, ctx.worker, ctx.attempt
    if sql.available() and ledger.statement_can_take(specs):
        rows = ledger.prepare(job, specs, statement_checks_recipients=True)
        born = ledger.born_final(rows, worker)
        if born is not None:
            done = _publish_one_statement(ctx, rows, *born)
            if done is not _REFUSED:
                return done
    # Every transactional effect's recipient is rechecked here, right before the publish.
    rows = ledger.prepare(job, specs)
    with clock.worker_transaction():
        if not transitions.publish(job, worker):
            return None
        if ctx.artifact is not None:
            ctx.artifact = artifacts.insert_row(ctx.artifact)
        effects = ledger.write(rows, worker)
        transitions.finish_attempt(attempt, Outcome.SUCCEEDED)
        # External sends leave this task: each gets its own message, committed with
        # the publish, so a slow provider never holds the job's delivery open.
        for effect in effects:
            if effect.state == ledger.State.PENDING:
                queue.enqueue_effect(effect)
    return effects


_REFUSED = object()  # the one-statement publish did not happen; the ORM path decides


def _publish_one_statement(
    ctx: JobContext, rows: list, notices: list, events: list, recipients: list
):
    """The one-statement publish: the effects, None if the CAS lost, or ``_REFUSED``."""
    job, worker = ctx.job, ctx.worker
    try:
        with transaction.atomic() if connection.in_atomic_block else nullcontext():
            done = sql.publish(
                job,
                worker,
                changes=transitions.publish_changes(),
                margin=conf.transaction_idle_seconds(),
                attempt_id=ctx.attempt.pk,
                artifact=ctx.artifact,
                effects=rows,
                notices=notices,
                events=events,
                recipients=recipients,
            )
    except DatabaseError as exc:  # e.g. a recipient deleted since the recheck
        log.warning(
            "job=%s one-statement publish refused (%s); ORM path", job.pk, type(exc).__name__
        )
        return _REFUSED
    if done.recipients_changed:
        log.info("job=%s a recipient's account changed; rechecking each one", job.pk)
        return _REFUSED
    if not done.won:
        return None
    transitions.mirror_publish(job, worker)
    ctx.attempt.outcome = Outcome.SUCCEEDED
    if ctx.artifact is not None:
        if done.artifact_id is None:  # a row from before rows moved into the publish
            ctx.artifact = artifacts.insert_row(ctx.artifact)
        else:
            ctx.artifact.pk = done.artifact_id
            ctx.artifact._state.adding = False
    for effect in rows:
        effect.pk = done.effect_ids.get(effect.effect_id)
        effect._state.adding = False
        if effect.effect_id in done.notice_ids:
            effect.provider_ref = f"notice:{done.notice_ids[effect.effect_id]}"
    ledger.log_born(rows, worker)
    return rows


def _handle_failure(ctx: JobContext, exc: Exception) -> DeliveryResult:
    job, worker, attempt = ctx.job, ctx.worker, ctx.attempt
    c = classify(exc)
    fields = {"error_class": c.error_class.value, "error_code": c.code}
    # The outcome and its attempt row commit together: a crash cannot leave a blank attempt.
    with clock.worker_transaction():
        state = job_outcome(
            c,
            attempts=job.attempts,
            max_attempts=job.max_attempts,
            outage_for=_outage_for(job),
            outage_window=conf.outage_window_seconds(),
        )
        if state in ("retry_wait", "outage_wait"):
            outage = state == "outage_wait"
            delay = (
                conf.outage_backoff(job.attempts)
                if outage
                else conf.backoff(job.attempts, retry_after=c.retry_after)
            )
            won = transitions.schedule_retry(
                job,
                worker,
                delay=delay,
                error_class=c.error_class,
                code=c.code,
                detail=c.detail,
                outage=outage,
            )
            outcome, fields["retry_delay_seconds"] = Outcome.RETRY, delay
        else:
            write, outcome = (
                (transitions.fail, Outcome.FAILED)
                if state == "failed"
                else (transitions.bury, Outcome.DEAD)
            )
            won = write(job, worker, error_class=c.error_class, code=c.code, detail=c.detail)
        if not won:
            outcome = Outcome.LEASE_LOST
        transitions.finish_attempt(attempt, outcome, **fields)
    return DeliveryResult(job.pk, outcome, worker)


def _outage_for(job: Job) -> float | None:
    """Seconds this job has been held up by an outage, by the server's clock at the claim."""
    if job.outage_since is None:
        return None
    db_now = getattr(job, "db_now", None)
    if db_now is None:
        return None
    return (db_now - job.outage_since).total_seconds()
