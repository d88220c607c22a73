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

from jobs import artifacts, clock, conf, executors, failures, registry
from jobs.delivery import publish
from jobs.engine import job_machine
from jobs.engine.plan import Claim
from jobs.exceptions import JobCancelled, JobError, LeaseLost
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
        """Raise LeaseLost unless this worker still holds the job; call before private reads.

        ``JobCancelled`` (a LeaseLost) when a cancel was asked for: stop, publish nothing.
        """
        if not executors.current().still_owner(self.job, self.worker):
            self._lost("is no longer held by this worker")
        self._owner_checked = True

    @property
    def cancelled(self) -> bool:
        """Whether a cancel was asked for: a long handler may look between its own steps."""
        return Job.objects.filter(pk=self.job.pk, cancel_requested_at__isnull=False).exists()

    def _lost(self, how: str):
        if self.cancelled:
            raise JobCancelled(f"job {self.job.pk}: a cancel was asked for")
        raise LeaseLost(f"job {self.job.pk} {how}")

    def heartbeat(self) -> None:
        """Extend the lease between stages of healthy work; raise LeaseLost if it is gone.

        A lease less than a third spent is left alone: the write would buy nothing,
        and the publish CAS fences a worker that lost its job anyway.
        """
        if time.monotonic() - self._lease_extended_at < conf.lease_seconds() / 3:
            return
        if not job_machine.heartbeat(self.job, self.worker):
            self._lost("was reclaimed before the heartbeat")
        self._lease_extended_at = time.monotonic()

    def store_artifact(self, data: bytes, *, content_type: str, extension: str) -> Artifact:
        """Store the job's artifact file, write-once under a name with its hash (a file
        with the same bytes is reused); its row commits with the publish.

        Ownership is checked here only if the handler has not checked it yet: a late
        writer can only add a file no row names, and the publish CAS fences the row.
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
    worker = worker or job_machine.worker_identity()
    claim = claim_for(job_id, worker)
    if claim.job is not None:
        job_id = claim.job.pk  # a message wakes its queue: the claim may take a better job
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
        return _lost(ctx, "lease lost during work")
    except KeyboardInterrupt:
        raise  # a signal to this process: it stops; the lease's expiry tells the rest
    except BaseException as exc:  # SystemExit too: the retry table decides; the worker lives
        return _handle_failure(ctx, exc)

    effects = _publish(ctx, specs)
    if effects is None:
        return _lost(ctx, "publish lost: another worker owns the job")
    ctx.stage("published")
    return DeliveryResult(
        job_id, Outcome.SUCCEEDED, worker, {e.effect_id: e.state for e in effects}
    )


def _lost(ctx: JobContext, why: str) -> DeliveryResult:
    """This worker's fence failed: a cancel was asked for (the job ends cancelled, this
    attempt with it) or another worker owns the job (nothing more to do here)."""
    job, worker = ctx.job, ctx.worker
    if job_machine.stop_cancelled(job.pk, worker):
        log.info("job=%s worker=%s stopped: a cancel was asked for", job.pk, worker)
        return DeliveryResult(job.pk, Outcome.CANCELLED, worker)
    job_machine.finish_attempt(ctx.attempt, Outcome.LEASE_LOST)
    log.info("job=%s worker=%s %s", job.pk, worker, why)
    return DeliveryResult(job.pk, Outcome.LEASE_LOST, worker)


def _publish(ctx: JobContext, specs: list) -> list | None:
    """running → succeeded with the artifact row, the effects and the attempt's outcome.

    One plan (``jobs.delivery.publish``), carried out by one statement where it can and by
    one ORM transaction elsewhere. If the account rule refuses a recipient at that
    moment, the plan is built again with that recipient withheld (each round
    withholds at least one more, so this ends). Returns the effects, or None when
    the fence failed (nothing was written).
    """
    refused: dict[str, str] = {}
    while True:
        plan = publish.build(ctx.job, ctx.worker, ctx.attempt, ctx.artifact, specs, refused=refused)
        result = publish.carry_out(plan)
        if result.status == publish.Status.WON:
            return result.effects
        if result.status == publish.Status.LOST:
            return None
        log.info("job=%s a recipient's account changed; withholding it", ctx.job.pk)
        refused.update(result.refused)


def _handle_failure(ctx: JobContext, exc: BaseException) -> DeliveryResult:
    job, worker, attempt = ctx.job, ctx.worker, ctx.attempt
    c = classify(exc)
    error = failures.capture(exc, redact=_redacts(job.kind))
    fields = {"error_class": c.error_class.value, "error_code": c.code, **error.attempt_fields()}
    # The outcome and its attempt row commit together: a crash cannot leave a blank attempt.
    with clock.worker_transaction():
        state = job_outcome(
            c,
            attempts=job.attempts,
            max_attempts=job.max_attempts,
            outage_for=_outage_for(job, attempt),
            outage_window=conf.outage_window_seconds(),
        )
        if state in ("retry_wait", "outage_wait"):
            outage = state == "outage_wait"
            delay = (
                conf.outage_backoff(job.attempts)
                if outage
                else conf.backoff(job.attempts, retry_after=c.retry_after)
            )
            won = job_machine.schedule_retry(
                job,
                worker,
                delay=delay,
                error_class=c.error_class,
                code=c.code,
                detail=c.detail,
                outage=outage,
                **error.job_fields(),
            )
            outcome, fields["retry_delay_seconds"] = Outcome.RETRY, delay
        else:
            write, outcome = (
                (job_machine.fail, Outcome.FAILED)
                if state == "failed"
                else (job_machine.bury, Outcome.DEAD)
            )
            won = write(
                job,
                worker,
                error_class=c.error_class,
                code=c.code,
                detail=c.detail,
                **error.job_fields(),
            )
        if not won and job_machine.stop_cancelled(job.pk, worker):
            outcome = Outcome.CANCELLED  # the failure came after a cancel was asked for
        elif not won:
            outcome = Outcome.LEASE_LOST
        job_machine.finish_attempt(attempt, outcome, **fields)
    # One line per failed attempt: ids, class, code and frames; never the message or params.
    line = {"job": job.pk, "kind": job.kind, "attempt": attempt.number, "outcome": outcome}
    line.update(error=error.type_path, code=c.code, frames=failures.frames_text(exc))
    log.warning(" ".join(f"{k}={v}" for k, v in line.items()), extra=line)
    return DeliveryResult(job.pk, outcome, worker)


def _redacts(kind: str):
    try:
        return registry.get_kind(kind).redact_errors
    except JobError:  # no such kind: its failure is the engine's own message
        return False


def _outage_for(job: Job, attempt: Attempt) -> float | None:
    """Seconds this job has been held up by an outage, by the server's clock at the claim
    (the attempt's start)."""
    if job.outage_since is None or attempt.started_at is None:
        return None
    return (attempt.started_at - job.outage_since).total_seconds()


def claim_for(job_id: int, worker: str, *, lease_seconds: float | None = None) -> Claim:
    """Claim ``job_id`` for ``worker`` with this process's executor, the configured lease
    (or ``lease_seconds``) and the tenant bound: the first step of every delivery."""
    lease = conf.lease_seconds() if lease_seconds is None else lease_seconds
    return executors.current().claim(job_id, worker, lease=lease, bound=conf.tenant_concurrency())
