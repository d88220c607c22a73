"""One delivery of one job: claim → produce → publish (external effects get their own message).

Returns only after every outcome is committed, so django-q2 acknowledges the
message only then. A worker that lost its lease publishes nothing; a second
delivery of a finished job is recorded and otherwise ignored.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from django.db.models import Expression, Model, QuerySet

from jobs import (
    artifacts,
    clock,
    conf,
    executors,
    failures,
    identity,
    registry,
    sequences,
    telemetry,
)
from jobs.delivery import publish, steps
from jobs.engine import groups, job_machine
from jobs.engine.plan import Claim
from jobs.exceptions import JobCancelled, JobError, JobTimeout, LeaseLost
from jobs.models import Artifact, Attempt, Job, JobStep
from jobs.retry import classify, job_outcome

log = logging.getLogger("jobs.runner")

Outcome = Attempt.Outcome
StageHook = Callable[[str, "JobContext"], None]
M = TypeVar("M", bound=Model)

# Progress is written at most this often (seconds); the calls between are kept, the last wins.
PROGRESS_INTERVAL = 1.0
NOTE_MAX = 120  # Job.progress_note's length
# The hard stop fires at least this long before django-q2's own alarm (Q_CLUSTER["timeout"]),
# which keeps counting: the attempt's failure is recorded in between.
HARD_STOP_MARGIN = 1.0


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
        self._owner_seen_at = time.monotonic()  # the claim (its adoption read) saw it held
        self.timeout: float | None = None  # the kind's, once the handler runs
        self._deadline = math.inf  # monotonic: past it, the next check raises JobTimeout
        self._stopped = False  # the worker's hard stop fired (``_time_limit``)
        self._shielded = 0  # inside the engine's own write: a hard stop waits for its end
        self._progress: tuple[int, int | None, str] | None = None  # not yet written
        # The claim is the job's first word on its progress: a handler's first second of
        # progress is kept and written by a later call, or with the publish.
        self._progress_written_at = time.monotonic()
        self._steps: dict[str, JobStep] | None = None  # read at the first step
        self._pending_steps: dict[str, JobStep] = {}  # recorded by the next fenced write
        self._pending_since = 0.0  # monotonic: the first pending step's start

    @property
    def params(self) -> dict:
        return self.job.params

    def stage(self, name: str) -> None:
        """Mark a stage; test hooks and drills pause or fail here."""
        telemetry.stage(name)
        if self._on_stage is not None:
            self._on_stage(name, self)

    def check_owner(self) -> None:
        """Raise LeaseLost unless this worker still holds the job; call before private reads.

        ``JobCancelled`` (a LeaseLost) when a cancel was asked for: stop, publish nothing;
        ``JobTimeout`` when the attempt ran past its kind's timeout.
        """
        self._check_time()
        with self._shield():
            owner = executors.current().still_owner(self.job, self.worker)
        if not owner:
            self._lost("is no longer held by this worker")
        self._owner_checked = True
        self._owner_seen_at = time.monotonic()

    def read(self, queryset: QuerySet[M]) -> list[M]:
        """Read ``queryset``'s rows only while this worker still holds the job: the owner
        check and the private read are one statement, so they see one snapshot (a worker
        that lost the job reads nothing) and cost one round trip instead of two.

        Raises like ``check_owner`` when the job is no longer this worker's; an empty
        list means the rows are not there (the check alone is then asked to tell which).
        """
        self._check_time()
        rows = list(queryset.filter(self._held()))
        if rows:
            self._owner_checked = True
            self._owner_seen_at = time.monotonic()
        else:
            self.check_owner()
        return rows

    def _held(self) -> Expression:
        """True while this context may read for its job (``read``'s fence)."""
        return executors.current().held_while(self.job, self.worker)

    def _check_time(self) -> None:
        """The cooperative stop: past the kind's timeout every check raises ``JobTimeout``."""
        if self._stopped or time.monotonic() > self._deadline:
            raise JobTimeout(f"job {self.job.pk} ran past its kind's timeout ({self.timeout:g} s)")

    @contextlib.contextmanager
    def _shield(self) -> Iterator[None]:
        """The engine's own statement (a fenced write, an owner check) is never cut in the
        middle by the hard stop: a stop that fires inside waits for its end, then raises."""
        self._shielded += 1
        try:
            yield
        finally:
            self._shielded -= 1
        if self._stopped and not self._shielded:
            self._check_time()

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
        and the publish CAS fences a worker that lost its job anyway. Progress kept
        for a second or more is written instead (that write extends the lease too).
        ``JobTimeout`` when the attempt ran past its kind's timeout.
        """
        self._check_time()
        if self._progress is not None and (
            time.monotonic() - self._progress_written_at >= PROGRESS_INTERVAL
        ):
            self._write_progress()  # kept progress is due: its write is the heartbeat
            return
        self._extend_lease()

    def _extend_lease(self) -> None:
        if time.monotonic() - self._lease_extended_at < conf.lease_seconds() / 3:
            return
        with self._shield():
            won = steps.record_pending(self, lambda: job_machine.heartbeat(self.job, self.worker))
        if not won:
            self._lost("was reclaimed before the heartbeat")
        self._lease_extended_at = time.monotonic()

    def progress(self, done: int, total: int | None = None, note: str = "") -> None:
        """Say how far the work is (``handle.progress`` reads it): ``done`` of ``total``
        units and a short note, which is shown to operators, so never private data.

        Written at most once a second (``PROGRESS_INTERVAL``), fenced like a heartbeat and
        extending the lease like one; a call inside the second is kept and the last one
        is written by the next call after it, or when the handler returns. Raises
        ``ValueError`` for a negative or non-integer count and for a note longer than
        120 characters or not one line of printable text; ``LeaseLost``/``JobCancelled``
        when the job is no longer this worker's; ``JobTimeout`` past the kind's timeout.
        """
        self._check_time()
        self._progress = _checked_progress(done, total, note)
        if time.monotonic() - self._progress_written_at >= PROGRESS_INTERVAL:
            self._write_progress()

    def _write_progress(self) -> None:
        if self._progress is None:
            return
        done, total, note = self._progress

        def write() -> bool:
            return job_machine.progress(self.job, self.worker, done=done, total=total, note=note)

        with self._shield():
            won = steps.record_pending(self, write)
        if not won:
            self._lost("was reclaimed before its progress was written")
        self._progress = None
        self._progress_written_at = self._lease_extended_at = time.monotonic()

    def store_artifact(self, data: bytes, *, content_type: str, extension: str) -> Artifact:
        """Store the job's artifact file, write-once under a name with its hash (a file
        with the same bytes is reused); its row commits with the publish.

        Ownership is checked here only if the handler has not checked it yet: a late
        writer can only add a file no row names, and the publish CAS fences the row.
        """
        if not self._owner_checked:
            self.check_owner()
        with self._shield():
            stored = artifacts.store(self.job, data, content_type=content_type, extension=extension)
        self.artifact = stored.artifact
        self.stage("artifact_stored")
        return stored.artifact

    def step(
        self,
        name: str,
        fn: Callable[[], object],
        *,
        lookup: Callable[[], object | None] | None = None,
    ) -> object:
        """Run ``fn`` as the durable step ``name``: once per job, its JSON output recorded
        under this worker's fence and returned to every later attempt (jobs.delivery.steps).
        ``lookup``: asked first by an attempt that finds the step begun but not finished
        (its outside call may have landed): an output found is recorded, ``fn`` not run."""
        return steps.run(self, name, fn, lookup=lookup)

    def joined(self) -> list[groups.JoinedChild]:
        """The children of the group this job is the join of, in the order their parent
        listed them: name, job id, kind, how each ended and its ``jobs.result``."""
        return groups.joined(self.job)

    def step_key(self, name: str) -> str:
        """The idempotency key for an outside call made inside step ``name``: the same
        for every attempt, so a repeated call is the same request."""
        return steps.key(identity.job_key(self.job), self.job.output_revision, name)


def _checked_progress(done: int, total: int | None, note: str) -> tuple[int, int | None, str]:
    """The progress as it will be stored; a ValueError that never quotes the note."""
    for name, value in (("done", done), ("total", total)):
        if value is None and name == "total":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"ctx.progress: {name} must be a whole number >= 0")
    if not isinstance(note, str):
        raise ValueError("ctx.progress: note must be a string")
    if len(note) > NOTE_MAX:
        raise ValueError(
            f"ctx.progress: a note is at most {NOTE_MAX} characters (this one has {len(note)}); "
            "it is shown to operators: counts and stage names, never private data"
        )
    if not note.isprintable():
        raise ValueError(
            "ctx.progress: a note is one line of printable text (no newline or control "
            "character); it is shown to operators, never private data"
        )
    return done, total, note


@dataclass
class DeliveryResult:
    job_id: int
    outcome: str
    worker: str
    effects: dict[str, str] = field(default_factory=dict)


def run_delivery(
    job_id: int, *, worker: str | None = None, on_stage: StageHook | None = None
) -> DeliveryResult:
    """Handle one delivery of the job ``job_id`` names, by the worker protocol in DESIGN.md
    (a claim by name: exactly that job, or why not)."""
    worker = worker or job_machine.worker_identity()
    claim = claim_for(job_id, worker)
    if not claim.won:
        return DeliveryResult(job_id, claim.status, worker)
    return run_claim(claim, worker, on_stage=on_stage)


def adopt(job_id: int, owner: str, attempt_id: int, version: int) -> Claim:
    """The claim the broker made for this worker (``jobs.claiming``), read back: one read,
    no write. ``stale`` when the job is no longer held under that claim (its lease ran
    out while the package waited, a cancel moved its version): the worker does nothing
    with it, as any worker that lost its lease."""
    read = executors.current().read_claim
    # The task's first query, and its connection's health check: no SELECT 1 before.
    attempt = clock.checked_by(lambda: read(job_id, attempt_id))
    if attempt is None:
        return Claim("missing")
    job = attempt.job
    # The lease has run since the claim, not since this read: the first heartbeat is
    # due a third of the lease after the claim (``JobContext._extend_lease``).
    attempt.claimed_ago = max(0.0, (attempt.db_now - attempt.started_at).total_seconds())
    held = (
        job.state == Job.State.RUNNING
        and job.lease_owner == owner
        and job.version == version
        and not attempt.outcome
    )
    return Claim("claimed" if held else "stale", job, attempt)


def run_adopted(
    job_id: int, owner: str, attempt_id: int, version: int, *, on_stage: StageHook | None = None
) -> DeliveryResult:
    """Run the job the broker claimed for this worker under ``owner``'s fence."""
    claim = adopt(job_id, owner, attempt_id, version)
    if not claim.won:
        log.info("job=%s attempt=%s claim not held here (%s)", job_id, attempt_id, claim.status)
        return DeliveryResult(job_id, claim.status, owner)
    return run_claim(claim, owner, on_stage=on_stage)


@telemetry.traced_attempt
def run_claim(claim: Claim, worker: str, *, on_stage: StageHook | None = None) -> DeliveryResult:
    """Produce and publish the job ``claim`` started for ``worker``."""
    job, attempt = claim.job, claim.attempt
    job_id = job.pk
    ctx = JobContext(job, worker, attempt, on_stage)
    ctx._lease_extended_at -= getattr(attempt, "claimed_ago", 0.0)
    ctx.stage("claimed")
    try:
        kind = registry.get_kind(job.kind)
        with _time_limit(ctx, kind.timeout):
            produced = kind.handler(ctx)
        output = registry.validate_output(produced)
        ctx.stage("before_publish")
        # A lease more than a third spent is extended before the fenced publish (the
        # engine's own step: a handler that returned inside its grace period publishes).
        ctx._extend_lease()
    except LeaseLost:
        return _lost(ctx, "lease lost during work")
    except KeyboardInterrupt:
        raise  # a signal to this process: it stops; the lease's expiry tells the rest
    except BaseException as exc:  # SystemExit too: the retry table decides; the worker lives
        failed = _handle_failure(ctx, exc)
        sequences.moved(job)  # an ending that lets its sequence go on (on_failure="skip")
        return failed

    waited_on = job.last_error_code if job.outage_since is not None else ""
    published = _publish(ctx, output)
    if published is None:
        return _lost(ctx, "publish lost: another worker owns the job")
    ctx.stage("published")
    effects = published.effects
    if not published.sequence_looked:
        sequences.moved(job)  # its effects may have settled in the publish: the next may start
    if waited_on:
        # This job met an outage and has now succeeded: what it waited for is back, and
        # the jobs still backing off from the same outage are due now, not at the end
        # of their backoff (up to JOBS_OUTAGE_BACKOFF_CAP_SECONDS).
        job_machine.wake_outage_waiters(waited_on, worker)
    return DeliveryResult(
        job_id, Outcome.SUCCEEDED, worker, {e.effect_id: e.state for e in effects}
    )


@contextlib.contextmanager
def _time_limit(ctx: JobContext, timeout: float | None) -> Iterator[None]:
    """Run the handler under its kind's ``timeout``: cooperatively (every check past it
    raises ``JobTimeout``) and, ``JOBS_TIMEOUT_GRACE_SECONDS`` later, by the hard stop.

    The hard stop is a SIGALRM timer (``setitimer``) whose handler raises ``JobTimeout``
    in the handler's frame, as django-q2 enforces ``Q_CLUSTER["timeout"]``; it shares
    that timer, so django-q2's alarm is saved and armed again with the time it has left,
    and the grace is cut to end ``HARD_STOP_MARGIN`` before that alarm.
    Signals reach only the main thread: elsewhere (a thread, ``sync``) the stop is
    cooperative only. A handler stopped this way publishes nothing, even if it caught
    the exception and returned.
    """
    if timeout is None:
        yield
        return
    ctx.timeout = timeout
    ctx._deadline = time.monotonic() + timeout
    limit = timeout + conf.timeout_grace_seconds()
    with _hard_stop(ctx, limit):
        yield
    if ctx._stopped:  # it swallowed the stop and returned: its result is not published
        ctx._check_time()


@contextlib.contextmanager
def _hard_stop(ctx: JobContext, limit: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        yield
        return
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if outer_delay > 0:  # django-q2's alarm: stop first, leaving it time to record the failure
        limit = min(limit, outer_delay - HARD_STOP_MARGIN)
        if limit <= 0:  # its alarm is this close (jobs.E007 refuses such a kind): it stops it
            yield
            return

    def stop(signum, frame):
        ctx._stopped = True
        if not ctx._shielded:  # else the engine's write raises it when it ends
            ctx._check_time()

    began = time.monotonic()
    outer_handler = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_delay > 0:  # django-q2's alarm, with the time it has left
            left = max(outer_delay - (time.monotonic() - began), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)
        if ctx._stopped:
            log.warning(
                "job=%s kind=%s stopped %.1f s after its start (timeout %g s and grace)",
                ctx.job.pk,
                ctx.job.kind,
                time.monotonic() - began,
                ctx.timeout,
            )
            _drop_interrupted_connections()


def _drop_interrupted_connections() -> None:
    """The stop may have cut a query of the handler's in the middle: close the connections
    (outside a transaction) so the failure is recorded on a fresh one."""
    from django.db import connections

    for conn in connections.all(initialized_only=True):
        if not conn.in_atomic_block:
            conn.close()


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


@telemetry.traced_publish
def _publish(ctx: JobContext, output: registry.Output) -> publish.Result | None:
    """running → succeeded with the artifact row, the effects and the attempt's outcome.

    One plan (``jobs.delivery.publish``), carried out by one statement where it can and by
    one ORM transaction elsewhere. If the account rule refuses a recipient at that
    moment, the plan is built again with that recipient withheld (each round
    withholds at least one more, so this ends). Returns the publish's result (its
    effects), or None when the fence failed (nothing was written).
    """
    refused: dict[str, str] = {}
    while True:
        plan = publish.build(
            ctx.job,
            ctx.worker,
            ctx.attempt,
            ctx.artifact,
            output,
            refused=refused,
            progress=ctx._progress,  # the handler's last second of progress rides on it
            steps=tuple(ctx._pending_steps.values()),  # and the steps not yet recorded
        )
        result = publish.carry_out(plan)
        if result.status == publish.Status.WON:
            return result
        if result.status == publish.Status.LOST:
            return None
        log.info("job=%s a recipient's account changed; withholding it", ctx.job.pk)
        refused.update(result.refused)


def _handle_failure(ctx: JobContext, exc: BaseException) -> DeliveryResult:
    job, worker, attempt = ctx.job, ctx.worker, ctx.attempt
    c = classify(exc, redact=_redacts(job.kind))
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
        if won:
            steps.write(steps.take_pending(ctx))  # a retry finds the steps this attempt did
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


def follow_on_budget() -> float:
    """``JOBS_FOLLOW_ON_SECONDS``: how long a worker keeps taking its queue's next work in
    one django-q2 task, cut so that a job taken at its end still has its kind's whole
    timeout and grace before django-q2's alarm (which counts from the task's start)."""
    budget = conf.follow_on_seconds()
    from django_q.conf import Conf

    q_timeout = Conf.TIMEOUT
    if budget <= 0 or not q_timeout or q_timeout < 0:
        return budget
    timeouts = [k.timeout for k in registry.kinds().values() if k.timeout]
    # A kind without a timeout has django-q2's alone: a followed job of it has that less
    # what the budget spent (docs/broker.md).
    longest = max(timeouts) + conf.timeout_grace_seconds() if timeouts else 0.0
    room = float(q_timeout) - longest - HARD_STOP_MARGIN
    return max(0.0, min(budget, room))
