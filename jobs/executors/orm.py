"""The ORM executor: the whole contract in Django's ORM (SQLite, psycopg2, any database).

The claim reads the job with the server's clock, judges it by ``jobs.rules``, and
either records why there is nothing to do (a duplicate delivery, a spent budget, a
flow rule's hold) or starts it: admission (``jobs.engine.admission``) and the
compare-and-swap run in one savepoint, so the starts a refused or lost claim took
are given back. The publish carries out a ``Plan`` in one worker transaction. The
PostgreSQL executor gives way to these for its documented refusals.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.db.models import Exists, Q, Subquery
from django.db.models.functions import Coalesce, Now

from jobs import clock, queue, rules
from jobs.engine import effect_machine, groups, job_machine
from jobs.engine.admission import admit
from jobs.engine.plan import Claim, Hold, Plan, Result, Status
from jobs.models import Attempt, Effect, EffectEvent, Job, Notice

log = logging.getLogger("jobs.executors")

name = "orm"
Outcome = Attempt.Outcome
State = Effect.State


class _NotStarted(Exception):
    """Rolls back the claim's savepoint: the starts admission took are given back."""

    def __init__(self, hold: Hold | None):
        self.hold = hold


def claim(job_id: int, worker: str, *, lease: float, bound: int) -> Claim:
    """queued, due retry_wait or expired running → running, or why not (recorded)."""
    with clock.worker_transaction():
        # The server's clock, read with the row: every decision and write below uses it.
        # ``flow_ruled``: an active flow rule on its kind or tenant (read in the same query).
        # Its queue's two candidates (``choose``) come whole in the same query.
        rows = list(_first_read(job_id))
        job = next((row for row in rows if row.pk == job_id), None)
        if job is None:
            log.warning("job=%s delivery for a job that does not exist", job_id)
            return Claim("missing")
        now, named = job.db_now, job
        candidates: list[Job] | None = [row for row in rows if row.pk != job_id]
        passed: set[int] = set()
        for _ in range(SWAP_RACES + 1):
            job = choose(named, now, candidates, passed=passed)
            verdict = _verdict(job, worker, now, lease=lease, bound=bound, swapped=job is not named)
            if verdict is not None:
                return verdict
            # The swapped job was started by another claim since the first read (its
            # start's CAS failed): this delivery chooses again without it.
            passed.add(job.pk)
            candidates = None
        return _verdict(named, worker, now, lease=lease, bound=bound, swapped=False)


# Swapped jobs a claim may find taken at its start before it keeps its named job.
SWAP_RACES = 3


def _verdict(
    job: Job, worker: str, now, *, lease: float, bound: int, swapped: bool
) -> Claim | None:
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


def choose(
    named: Job, now, candidates: list[Job] | None = None, *, passed: set[int] | None = None
) -> Job:
    """The job this delivery claims: ``named``, unless its queue has a due job at least
    ``rules.SWAP_MARGIN`` levels more urgent by effective priority, or ``named`` is not
    claimable and its queue has a due job (docs/app/scheduling.md).

    ``candidates``: the queue's due job best by priority and its longest waiting one, read
    with ``named`` (``_first_read``); None reads them here. A named job that needs its
    own verdict (``rules.OWN_VERDICT``: an expired lease, a spent budget) keeps the
    delivery. On PostgreSQL the job taken is held by its claim lock, tried, never waited
    for (``_claim_lock``): a job another claim is deciding about is passed over, so
    concurrent claims take different jobs. The same choice as the PostgreSQL statement's
    (``tests/jobs/test_executor_contract.py``).
    """
    if rules.holds(rules.OWN_VERDICT, named, now=now):
        return named
    aging = rules.aging_seconds()
    claimable = rules.holds(rules.CLAIMABLE, named, now=now)
    margin = rules.effective_priority(named, now, aging) + rules.SWAP_MARGIN
    passed = set(passed or ())
    for attempt in range(9):  # a job another claim holds is passed over (8 at once)
        if attempt == 0 and candidates is not None:
            # Read with the named job: nothing more to read when it is the one.
            found = candidates
        else:
            found = [c for c in _candidates(named.queue, exclude=passed) if c.pk != named.pk]
        best, best_key = None, None
        for candidate in found:
            key = -rules.effective_priority(candidate, now, aging)
            key = (key, rules.waiting_since(candidate), candidate.pk)
            if best_key is None or key < best_key:
                best, best_key = candidate, key
        if claimable and (best is None or -best_key[0] < margin):
            if _claim_lock(named.pk):
                return named
            claimable = False  # another claim is deciding about it: the queue's next
            passed.add(named.pk)
            continue
        if best is None:
            return named
        taken = _take_candidate(best)
        if taken is not None:
            taken.db_now = now
            return taken
        passed.add(best.pk)
    return named


_BY_PRIORITY = ("-priority", Coalesce("next_attempt_at", "created_at"), "pk")
_BY_WAIT = (Coalesce("next_attempt_at", "created_at"), "pk")


def _first_read(job_id: int):
    """The named job and its queue's two candidates, whole, in one query: the due job
    best by priority and the one waiting longest (two index scans on the named job's
    queue, each run once), each row with the server's clock and ``flow_ruled``.

    A swap then costs no ORM query: the candidate's row is already here.
    """
    named_queue = Subquery(Job.objects.filter(pk=job_id).values("queue")[:1])
    due = Job.objects.filter(rules.to_q(rules.CLAIMABLE), queue=named_queue)
    top = Subquery(due.order_by(*_BY_PRIORITY).values("pk")[:1])
    oldest = Subquery(due.order_by(*_BY_WAIT).values("pk")[:1])
    return Job.objects.annotate(db_now=Now(), flow_ruled=rules.flow_ruled_q()).filter(
        Q(pk=job_id) | Q(pk=top) | Q(pk=oldest)
    )


def _candidates(queue_name: str, *, exclude: set[int]) -> list[Job]:
    """The queue's due job best by priority and its longest waiting one (two index scans)."""
    base = Job.objects.filter(rules.to_q(rules.CLAIMABLE), queue=queue_name)
    if exclude:
        base = base.exclude(pk__in=exclude)
    found = {}
    for order in (_BY_PRIORITY, _BY_WAIT):
        for job in base.order_by(*order)[:1]:
            found[job.pk] = job
    return list(found.values())


def _claim_lock(pk: int) -> bool:
    """PostgreSQL: try the job's own advisory claim lock (the one the claim statement
    tries), held to this transaction's end; False when another claim holds it. Never a
    row lock: a claim holding a job's row while it waits for a scope's lock that a
    statement holds, whose update waits for that row, would deadlock. SQLite: True
    (``transaction_mode=IMMEDIATE`` serializes every writer)."""
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_try_advisory_xact_lock(%s, hashtext(%s))", [rules.CLAIM_LOCK_CLASS, str(pk)]
        )
        return bool(cursor.fetchone()[0])


def _take_candidate(candidate: Job) -> Job | None:
    """The candidate under its claim lock, or None when another claim holds that lock.

    SQLite: the row as read (the claim's ``BEGIN IMMEDIATE`` has held the only write lock
    since the read). PostgreSQL: the row read before the lock is taken as it was; a claim
    that started it in between moved its version, so this claim's start (a CAS on that
    version) fails and ``claim`` chooses again without it (``_verdict``). A row from
    ``_candidates`` (without ``flow_ruled``) is read again whole under the lock.
    """
    if connection.vendor == "postgresql" and not _claim_lock(candidate.pk):
        return None
    if getattr(candidate, "flow_ruled", None) is None:  # from ``_candidates``
        return _reread(candidate.pk)
    return candidate


def _reread(pk: int) -> Job | None:
    rows = Job.objects.filter(rules.to_q(rules.CLAIMABLE), pk=pk)
    return rows.annotate(flow_ruled=rules.flow_ruled_q()).first()


def _admit_and_start(
    job: Job, worker: str, now, *, lease: float, bound: int, reclaiming: bool, swapped: bool
) -> Claim | None:
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
        code = refused.hold.code
        return Claim("deferred", job, _record(job, worker, now, Outcome.DEFERRED, "", code))
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
        job=job, number=job.attempts, worker=worker, started_at=started
    )
    job_machine.log_arrow(job, "claim", worker, reclaimed=reclaiming)
    return Claim("claimed", job, attempt)


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
    return Claim("duplicate", job, _record(job, worker, now, Outcome.DUPLICATE_DELIVERY))


def still_owner(job: Job, worker: str) -> bool:
    """Whether ``worker`` holds ``job`` at the version it last wrote, on a live lease."""
    return job_machine.still_owner(job, worker)


def held_while(job: Job, worker: str) -> Exists:
    """``still_owner`` as a condition of another query."""
    return Exists(job_machine.owner_holds(job, worker))


# --- publish ----------------------------------------------------------------------------


def refused_accounts(accounts: tuple[str, ...]) -> dict[str, str]:
    """The recipients the account rule refuses now, with the reason."""
    if not accounts:
        return {}
    user = get_user_model()
    found = {
        str(pk): ok
        for pk, ok in user._default_manager.filter(pk__in=accounts)
        .annotate(admitted=rules.admitted(user))
        .values_list("pk", "admitted")
    }
    refused = {}
    for recipient in accounts:
        ok = found.get(recipient)
        if ok is None:
            refused[recipient] = rules.ACCOUNT_MISSING
        elif not ok:
            refused[recipient] = rules.ACCOUNT_REFUSED
    return refused


def publish(plan: Plan) -> Result:
    """Carry out ``plan`` in one worker transaction (its lock timeout bounds every wait)."""
    job, worker = plan.job, plan.worker
    with clock.worker_transaction():
        refused = refused_accounts(plan.accounts)
        if refused:
            return Result(Status.ACCOUNTS_REFUSED, name, refused)
        if not job_machine.publish(job, worker, margin=plan.margin, changes=dict(plan.changes)):
            return Result(Status.LOST, name)
        groups.write(plan.follow_ups, plan.groups)
        job_machine.finish_attempt(plan.attempt, Attempt.Outcome.SUCCEEDED)
        if plan.artifact is not None:
            plan.artifact.save(force_insert=True)
        failed_applies = _insert_effects(plan)
        # External sends leave this task: each gets its own message, committed with
        # the publish, so a slow provider never holds the job's delivery open.
        for effect in plan.effects:
            if effect.effect_id in plan.enqueues:
                queue.enqueue_effect(effect)
        for effect in failed_applies:
            queue.enqueue_effect(effect)
    effect_machine.log_born(plan.effects, worker)
    return Result(Status.WON, name, effects=list(plan.effects))


def _insert_effects(plan: Plan) -> list[Effect]:
    """The effect rows, their notices and events, and the other providers' applies.

    Returns the effects whose apply failed (back to pending: they need a message).
    """
    if not plan.effects:
        return []
    Effect.objects.bulk_create(plan.effects)
    by_id = {e.effect_id: e for e in plan.effects}
    notices = []
    for effect_id, notice in plan.notices:
        notice.effect = by_id[effect_id]
        notices.append(notice)
    Notice.objects.bulk_create(notices)
    for notice in notices:
        notice.effect.provider_ref = rules.notice_reference(notice.pk)
    if notices:
        Effect.objects.bulk_update([n.effect for n in notices], ["provider_ref"])
    events = []
    for effect_id, event in plan.events:
        event.effect = by_id[effect_id]
        events.append(event)
    applied = [by_id[i] for i in plan.applies]
    events += effect_machine.apply_in_publish(applied, plan.worker)
    EffectEvent.objects.bulk_create(events)
    # An apply that failed went back to pending: it leaves with a message too.
    return [e for e in applied if e.state == State.PENDING]
