"""The claim of a job a message names (django-q2's message brokers): the same on every
database, and the PostgreSQL executor's too.

It reads the named job with its queue's two candidates and the server's clock,
chooses (``choose``: the named job, unless its queue has one more urgent by
``rules.SWAP_MARGIN``), and decides about the chosen job (``verdict.decide``): nothing
to do, recorded as what it was, or admission and the start. Where the jobs table is
the queue (``jobs.claiming``) no message names a job, and the next-job claim
(``jobs.executors.pgclaim``) is used instead.
"""

from __future__ import annotations

import logging

from django.db import connection
from django.db.models import Q, Subquery
from django.db.models.functions import Coalesce, Now

from jobs import clock, rules
from jobs.engine import verdict
from jobs.engine.plan import Claim
from jobs.models import Job

log = logging.getLogger("jobs.executors")


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
            swapped = job is not named
            decided = verdict.decide(job, worker, now, lease=lease, bound=bound, swapped=swapped)
            if decided is not None:
                return decided
            # The swapped job was started by another claim since the first read (its
            # start's CAS failed): this delivery chooses again without it.
            passed.add(job.pk)
            candidates = None
        return verdict.decide(named, worker, now, lease=lease, bound=bound, swapped=False)


# Swapped jobs a claim may find taken at its start before it keeps its named job.
SWAP_RACES = 3


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
    version) fails and ``claim`` chooses again without it (``verdict.decide``). A row from
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
