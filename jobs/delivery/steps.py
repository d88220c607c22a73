"""Durable steps: ``ctx.step(name, fn)`` runs ``fn`` once per job, across attempts.

The first attempt that completes a step records its output (small JSON) with the next
fenced write of the job this attempt makes (a compare-and-swap on this worker's name, the
version it read and a live lease): its progress or heartbeat, another step's record, the
failure's arrow that schedules the retry, or the publish, in that write's transaction. A
later attempt finds the row and returns the output without calling ``fn``. A worker that
lost the job (its lease expired and another took it, or a cancel was asked for) cannot
record: its swap fails, nothing is written, and the delivery ends as a lost lease, like a
late publish. So at most one output per step, and only from a worker that held the job
when it wrote. Riding on the next write, three steps of a fast job cost no commit of
their own (each used to cost one); steps done over ``RIDE_SECONDS`` ago are recorded at
the end of the next step, by a write of their own, so a crash redoes at most about a
second of step work besides the step it stopped in.

What is not promised: ``fn`` itself may run more than once when an attempt dies between
its end and that write (a crash, a stop, a lost lease). A step that calls the outside
world passes ``ctx.step_key(name)`` as the call's idempotency key, so a repeat is the same
request to a provider that honours keys (docs/app/steps.md), or gives a ``lookup``.

A step given a ``lookup`` does better: it is recorded as *begun* (a row without
``finished_at``, under the same fence) before ``fn`` runs, and an attempt that finds it
begun but not finished asks ``lookup()`` first. An output found is recorded as the
step's and ``fn`` does not run; None ("never seen") runs ``fn``; a lookup that raises
fails the attempt (retried by the table), never a blind second call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from django.db import transaction
from django.utils import timezone

from jobs import telemetry
from jobs.engine import job_machine
from jobs.engine.publishing import write_steps as write
from jobs.exceptions import PayloadInvalid
from jobs.models import Job, JobStep

log = logging.getLogger("jobs.runner")

NAME_MAX = 64
# The longest step work (from the first unrecorded step's start) that waits for another
# fenced write before it is recorded by one of its own.
RIDE_SECONDS = 1.0
# Step outputs live in the job's database rows: small references, not documents. Bytes
# belong in the artifact (``ctx.store_artifact``).
OUTPUT_MAX_BYTES = 64 * 1024


class JobContext(Protocol):
    """What a step needs of ``jobs.delivery.runner.JobContext`` (no import: the runner
    imports this module)."""

    job: Job
    worker: str
    _lease_extended_at: float
    _steps: dict[str, JobStep] | None  # the job's recorded steps, read once an attempt
    _pending_steps: dict[str, JobStep]  # done by this attempt, riding on the next write
    _pending_since: float  # monotonic: when the first of them started
    _owner_seen_at: float  # monotonic: the last read or write that found the job held

    def stage(self, name: str) -> None: ...
    def check_owner(self) -> None: ...
    def _check_time(self) -> None: ...
    def _shield(self) -> contextlib.AbstractContextManager[None]: ...
    def _lost(self, how: str) -> None: ...


def key(job_key: str, revision: int, name: str) -> str:
    """The step's stable identity, the same for every attempt of the job: ``job_key`` is
    the job's identity for keys (``jobs.identity.job_key``: its uid, or its id for a job
    made before uids), never an id a failover could hand out again."""
    return f"job-{job_key}-r{revision}-step-{name}"


@telemetry.traced_step
def run(
    ctx: JobContext,
    name: str,
    fn: Callable[[], Any],
    *,
    lookup: Callable[[], Any] | None = None,
) -> Any:
    """The step's recorded output, running ``fn`` only when no attempt has recorded it.

    ``lookup``: asked, instead of running ``fn`` again, when an earlier attempt began the
    step and did not finish it; returns the output ``fn`` would have returned when the
    outside world already did the work (e.g. a provider's answer for the step's key), or
    None when it never saw the call.
    """
    _check_name(name)
    pending = ctx._pending_steps.get(name)
    if pending is not None:
        return pending.output  # this attempt ran it: its record rides on the next write
    row = _recorded(ctx).get(name)
    if row is not None and row.finished_at is not None:
        log.info("job=%s step=%s reused from attempt %s", ctx.job.pk, name, row.attempt)
        ctx.stage(f"step_reused:{name}")
        return row.output
    # Past the kind's timeout no step starts (a done one above is still returned: it
    # costs nothing); then no step starts for a job this worker was not seen to hold in
    # the last RIDE_SECONDS (a fenced read, a check, a fenced write, the claim): a stale
    # worker's quick step inside that second cannot be recorded anyway (the fence).
    ctx._check_time()
    if time.monotonic() - max(ctx._owner_seen_at, ctx._lease_extended_at) >= RIDE_SECONDS:
        ctx.check_owner()
    started = timezone.now()
    if row is not None and lookup is not None:
        # Begun by an attempt that did not finish: its call may have been done.
        ctx.stage(f"step_lookup:{name}")
        found = lookup()
        log.info(
            "job=%s step=%s begun by attempt %s, not finished: lookup %s",
            ctx.job.pk,
            name,
            row.attempt,
            "found its outcome" if found is not None else "found nothing, running it",
        )
        if found is not None:
            return _finish(ctx, name, _stored_form(name, found), started)
    elif lookup is not None and _record(ctx, name, None, started, begun=True) is None:
        _refused(ctx, name)
    ctx.stage(f"step_started:{name}")
    began = time.monotonic()
    output = _stored_form(name, fn())
    ctx.stage(f"step_done:{name}")
    if lookup is not None or row is not None:
        # A row of its own (begun by an earlier attempt's lookup step) is finished now.
        return _finish(ctx, name, output, started)
    ctx._pending_steps[name] = JobStep(
        job_id=ctx.job.pk,
        name=name,
        output=output,
        attempt=ctx.job.attempts,
        worker=ctx.worker,
        started_at=started,
        finished_at=timezone.now(),
    )
    if len(ctx._pending_steps) == 1:
        ctx._pending_since = began
    if time.monotonic() - ctx._pending_since >= RIDE_SECONDS:
        # Long enough to be worth a commit of its own: recorded now, fenced.
        with ctx._shield():
            won = record_pending(ctx, lambda: job_machine.heartbeat(ctx.job, ctx.worker))
        if not won:
            _refused(ctx, name)
        ctx._lease_extended_at = time.monotonic()
    return output


def _recorded(ctx: JobContext) -> dict[str, JobStep]:
    """The job's recorded steps, read at the attempt's first step: while this worker holds
    the job no other can record one (the fence), so the read stays true."""
    if ctx._steps is None and ctx.job.attempts == 1 and getattr(ctx, "attempt", None):
        ctx._steps = {}  # the job's first claim: no attempt before it could record one
    if ctx._steps is None:
        ctx._steps = {s.name: s for s in JobStep.objects.filter(job_id=ctx.job.pk)}
    return ctx._steps


def take_pending(ctx: JobContext) -> tuple[JobStep, ...]:
    """The steps this attempt finished and has not recorded yet, handed to the write that
    records them (it must be fenced, and record them in its transaction)."""
    pending = tuple(ctx._pending_steps.values())
    ctx._pending_steps.clear()
    return pending


def record_pending(ctx: JobContext, fenced_write: Callable[[], bool]) -> bool:
    """Run ``fenced_write`` (a compare-and-swap of this worker's job) and, if it won, record
    the pending steps in its transaction; False when it lost (nothing written)."""
    if not ctx._pending_steps:
        return fenced_write()
    pending = take_pending(ctx)
    job = ctx.job
    before = (job.version, job.state, job.lease_expires_at)  # the swap mirrors itself
    try:
        with transaction.atomic():
            if not fenced_write():
                return False
            write(pending)
    except BaseException:
        # Rolled back: the job's row keeps its version, and the steps wait for a write.
        job.version, job.state, job.lease_expires_at = before
        ctx._pending_steps.update({row.name: row for row in pending})
        raise
    return True


def _finish(ctx: JobContext, name: str, output: Any, started) -> Any:
    recorded = _record(ctx, name, output, started)
    if recorded is None:
        _refused(ctx, name)
    log.info("job=%s step=%s recorded attempt=%s", ctx.job.pk, name, recorded.attempt)
    return recorded.output


def _refused(ctx: JobContext, name: str) -> None:
    log.info(
        "job=%s step=%s refused: worker=%s no longer holds the job",
        ctx.job.pk,
        name,
        ctx.worker,
    )
    ctx._lost(f"step {name!r} not recorded: the job is no longer held by this worker")


def _record(
    ctx: JobContext, name: str, output: Any, started, *, begun: bool = False
) -> JobStep | None:
    """The fenced swap and the step's row in one transaction: the row that stands for the
    step, or None when the fence failed (nothing written). ``begun``: the row says only
    that ``fn`` is about to run (no output, no ``finished_at``); a later record of the
    same step finishes that row."""
    job = ctx.job
    # The swap mirrors itself on ctx.job; if the transaction then fails (the database went
    # away mid-insert), it is rolled back, and so is the mirror: the failure is recorded
    # against the version the row still has, not reported as a lost lease.
    before = (job.version, job.state, job.lease_expires_at)
    with ctx._shield():  # a hard stop inside waits for the commit, then raises
        try:
            with transaction.atomic():
                if not job_machine.heartbeat(job, ctx.worker):
                    return None
                write(take_pending(ctx))  # what this attempt finished before rides along
                fields = {
                    "output": output,
                    "attempt": job.attempts,
                    "worker": ctx.worker,
                    "started_at": started,
                    "finished_at": None if begun else timezone.now(),
                }
                step, created = JobStep.objects.get_or_create(
                    job_id=job.pk, name=name, defaults=fields
                )
                if not created and step.finished_at is None and not begun:
                    # This worker holds the job (the swap above): it finishes the row
                    # an earlier attempt began.
                    for field, value in fields.items():
                        setattr(step, field, value)
                    step.save(update_fields=list(fields))
        except BaseException:
            job.version, job.state, job.lease_expires_at = before
            raise
    ctx._lease_extended_at = time.monotonic()
    if ctx._steps is not None:
        ctx._steps[name] = step
    return step


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name or len(name) > NAME_MAX or not name.isprintable():
        raise PayloadInvalid(f"ctx.step: a step name is 1-{NAME_MAX} printable characters")


def _stored_form(name: str, output: Any) -> Any:
    """The output as every later attempt will read it back (a JSON round trip: tuples
    become lists, keys strings), so the first attempt gets the same value; an output that
    cannot be stored (not JSON, NaN or infinity, which PostgreSQL's jsonb refuses, too big)
    fails the job once, naming the step, never quoting the value."""
    try:
        text = json.dumps(output, allow_nan=False)
    except (TypeError, ValueError):
        raise PayloadInvalid(
            f"ctx.step {name!r}: the output must be JSON (dicts, lists, strings, finite numbers)"
        ) from None
    size = len(text.encode())
    if size > OUTPUT_MAX_BYTES:
        raise PayloadInvalid(
            f"ctx.step {name!r}: the output is {size} bytes of JSON, more than "
            f"{OUTPUT_MAX_BYTES}; store bytes with ctx.store_artifact"
        )
    return json.loads(text)
