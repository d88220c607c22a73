"""One delivery of one job: claim → produce → publish (external effects get their own message).

Returns only after every outcome is committed, so django-q2 acknowledges the
message only then. A worker that lost its lease publishes nothing; a second
delivery of a finished job is recorded and otherwise ignored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from jobs import artifacts, clock, conf, ledger, queue, registry, transitions
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
        """Store (or verify) the job's one artifact under its stable key."""
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

    effects = []
    with clock.worker_transaction():
        if not transitions.publish(job, worker):
            published = False
        else:
            published = True
            effects = ledger.record(job, specs, worker)
            transitions.finish_attempt(attempt, Outcome.SUCCEEDED)
            # External sends leave this task: each gets its own message, committed with
            # the publish, so a slow provider never holds the job's delivery open.
            for effect in effects:
                if effect.state == ledger.State.PENDING:
                    queue.enqueue_effect(effect)
    if not published:
        transitions.finish_attempt(attempt, Outcome.LEASE_LOST)
        log.info("job=%s worker=%s publish lost: another worker owns the job", job.pk, worker)
        return DeliveryResult(job_id, Outcome.LEASE_LOST, worker)
    ctx.stage("published")
    return DeliveryResult(
        job_id, Outcome.SUCCEEDED, worker, {e.effect_id: e.state for e in effects}
    )


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
