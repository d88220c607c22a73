"""What a claim decides about the one job it holds, the same on every database.

The job was read with the server's clock (``db_now``) and ``flow_ruled``, and is held by
its claim: under its row lock (PostgreSQL's next-job claim), its claim lock or the only
write lock (SQLite's ``BEGIN IMMEDIATE``). A delivery that finds nothing to do is
recorded as what it was (a duplicate delivery, a spent budget buried, a cancel
honoured); otherwise admission (``jobs.engine.admission``, on PostgreSQL its function)
and the compare-and-swap start it, or the admission's hold defers it, spending no
attempt and writing no attempt row: the look is counted on the job (``held_looks``).
"""

from __future__ import annotations

from contextlib import nullcontext
from datetime import timedelta

from django.db import connection, transaction
from django.db.models.functions import Now

from jobs import rules, telemetry
from jobs.engine import job_machine
from jobs.engine.admission import admit
from jobs.engine.plan import Claim, Hold
from jobs.models import Attempt, Job

Outcome = Attempt.Outcome


class _NotStarted(Exception):
    """Rolls back the claim's savepoint: the starts admission took are given back."""

    def __init__(self, hold: Hold | None):
        self.hold = hold


def decide(job: Job, worker: str, now, *, lease: float, bound: int, swapped: bool) -> Claim | None:
    """What this delivery does with ``job``; None when ``job`` was swapped in and another
    claim started it first (its version moved since the read)."""
    live = rules.holds(rules.LIVE_RUNNING, job, now=now)
    early = rules.holds(rules.WAITING, job, now=now) and not rules.holds(rules.DUE, job, now=now)
    if job.is_terminal or live or early:
        job_machine.log_arrow(job, "duplicate_delivery", worker, state=job.state)
        return _duplicate(job, worker, now)
    reclaiming = job.state == Job.State.RUNNING
    if reclaiming and job.cancel_requested_at is not None:
        # Its worker died after a cancel was asked for: the job ends here, not rerun.
        if not job_machine.stop_cancelled(job.pk, worker):
            return _duplicate(job, worker, now)
        return Claim("cancelled", job, _record(job, worker, now, Outcome.CANCELLED))
    if not rules.holds(rules.HAS_BUDGET, job, now=now):
        won, error_class, code = job_machine.bury_spent(job, now=now, reclaiming=reclaiming)
        if not won:
            return _duplicate(job, worker, now)
        return Claim("buried", job, _record(job, worker, now, Outcome.DEAD, error_class, code))
    return _admit_and_start(
        job, worker, now, lease=lease, bound=bound, reclaiming=reclaiming, swapped=swapped
    )


def _admit_and_start(
    job: Job, worker: str, now, *, lease: float, bound: int, reclaiming: bool, swapped: bool
) -> Claim | None:
    # Due since (the attempt's wait): a reclaimed job when its lease ran out.
    due = job.lease_expires_at if reclaiming else (job.next_attempt_at or job.created_at)
    if not _row_taken(job):
        # A claim statement holds the row (it may be starting it): never wait for it.
        if swapped:
            return None
        job_machine.log_arrow(job, "passed", worker, reason="row_held")
        return Claim("passed", job)
    # A savepoint when a flow rule may take rate starts: they stand only with the claim's
    # swap. Without one, admission writes nothing (the tenant's count under its lock).
    try:
        with transaction.atomic() if job.flow_ruled else nullcontext():
            hold = admit(job, ruled=job.flow_ruled, default_tenant_bound=bound)
            if hold is not None:
                raise _NotStarted(hold)
            if not job_machine.start(job, worker, lease=lease, now=now):
                raise _NotStarted(None)
    except _NotStarted as refused:
        if refused.hold is None and swapped:
            return None  # another claim started it since the read: choose again
        if refused.hold is None:
            job_machine.log_arrow(job, "duplicate_delivery", worker, reason="claim_race")
            return _duplicate(job, worker, now)
        if not job_machine.defer(job, worker, now=now, hold=refused.hold, reclaiming=reclaiming):
            return _duplicate(job, worker, now)
        return Claim("deferred", job, hold=refused.hold)  # counted on the job: no attempt row
    if reclaiming:
        job_machine.close_open_attempts(job, now)
    started = now
    if connection.vendor == "postgresql" and (job.flow_ruled or job.tenant_key):
        # The claim may have waited for a lock: the attempt starts when its lease did
        # (read back from the row), so its record shows the bound exactly. A later
        # clock reading put the start, and so the lease it implies, tens of ms late
        # on a busy host, and a job claimed right after the lease ran out looked like
        # a breach of a tenant's concurrency 1 (seen in a soak).
        expires = Job.objects.values_list("lease_expires_at", flat=True).get(pk=job.pk)
        started = expires - timedelta(seconds=lease)
    attempt = Attempt.objects.create(
        job=job, number=job.attempts, worker=worker, started_at=started, due_at=due
    )
    job_machine.log_arrow(job, "claim", worker, reclaimed=reclaiming)
    return Claim("claimed", job, attempt)


def _row_taken(job: Job) -> bool:
    """PostgreSQL, a job whose admission takes scope locks: its row locked first, tried,
    never waited for (False when another transaction holds it).

    Rows before scopes: the next-job claim statement locks its candidate rows and then
    waits for the scope locks; a claim here that held a scope's lock and then waited
    for one of those rows (its start's UPDATE) would close a circle, and the server
    would end one of the two as a deadlock. Elsewhere, and for a job no scope governs,
    True: nothing here waits for a scope while holding it.
    """
    if connection.vendor != "postgresql" or not (job.flow_ruled or job.tenant_key):
        return True
    table = connection.ops.quote_name(Job._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR UPDATE SKIP LOCKED", [job.pk])
        return cursor.fetchone() is not None


def _record(job: Job, worker: str, now, outcome: str, error_class="", error_code="") -> Attempt:
    """A delivery that did no work is still an attempt row: deliveries count apart."""
    return Attempt.objects.create(
        job=job,
        number=0,
        worker=worker,
        started_at=now,
        finished_at=now,
        outcome=outcome,
        error_class=error_class,
        error_code=error_code,
    )


def _duplicate(job: Job, worker: str, now) -> Claim:
    telemetry.duplicate_delivery(job)
    return Claim("duplicate", job, _record(job, worker, now, Outcome.DUPLICATE_DELIVERY))


def defer(job_id: int, worker: str, hold: Hold) -> Claim:
    """Record the admission's hold on a waiting job the claim picked (its verdict, decided
    once): due again after ``hold.delay``, no attempt spent. A job no longer waiting, or
    changed since this read (another claim started it once the verdict's statement had
    committed), is left as it is, with nothing recorded: ``passed``."""
    job = Job.objects.annotate(db_now=Now()).filter(pk=job_id).first()
    if job is None:
        return Claim("missing")
    now = job.db_now
    if not rules.holds(rules.WAITING, job, now=now):
        # Another claim started it between the verdict's commit and this read: the
        # verdict no longer applies; nothing is written (it is that claim's job now).
        return Claim("passed")
    if not job_machine.defer(job, worker, now=now, hold=hold, reclaiming=False):
        return Claim("passed")
    return Claim("deferred", job, hold=hold)  # counted on the job (held_looks): no attempt row
