"""The claim of one named job, and the ORM's reads of a queue's candidates.

A named claim takes exactly the job it names, or nothing: it is how a job is run by id
outside a cluster's claim (``jobs.delivery.runner.run_delivery``: django-q2's ``sync``,
the practice drill, ``jobs.testing``, a message of an older version). Queue order is the
next-job claim's (``jobs.executors.pgclaim``, ``ormclaim``); a named claim never swaps.
It reads the job with the server's clock and decides (``verdict.decide``: nothing to
do, recorded as what it was, or the job's row taken, admission and the start), the same
decision as every other claim's, on every database.
"""

from __future__ import annotations

import logging

from django.db import connection
from django.db.models.functions import Coalesce, Now

from jobs import clock, rules
from jobs.engine import verdict
from jobs.engine.plan import Claim
from jobs.models import Job

log = logging.getLogger("jobs.executors")

# How many times a claim passes over a job another claim took between its read and its
# start before it gives way (``ormclaim.claim_next``).
PASS_RACES = 3


def claim(job_id: int, worker: str, *, lease: float, bound: int) -> Claim:
    """queued, due retry_wait or expired running → running, or why not (recorded)."""
    with clock.worker_transaction():
        # Another claim deciding about this job finishes first (its claim lock, waited for
        # within the lock timeout; it holds nothing this claim holds): then the job is
        # read as that claim left it, and a second claim of a started job is recorded as
        # the duplicate delivery it is.
        _wait_for_claim_lock(job_id)
        job = _read(job_id).first()
        if job is None:
            log.warning("job=%s delivery for a job that does not exist", job_id)
            return Claim("missing")
        decided = verdict.decide(job, worker, job.db_now, lease=lease, bound=bound, swapped=False)
        return decided if decided is not None else Claim("passed", job)


def _wait_for_claim_lock(pk: int) -> None:
    """PostgreSQL: the job's advisory claim lock, waited for, held to this transaction's
    end. SQLite: nothing (``transaction_mode=IMMEDIATE`` serializes every writer)."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [rules.CLAIM_LOCK_CLASS, str(pk)]
        )


_BY_PRIORITY = ("-priority", Coalesce("next_attempt_at", "created_at"), "pk")
_BY_WAIT = (Coalesce("next_attempt_at", "created_at"), "pk")


def _read(job_id: int):
    """The job with the server's clock and ``flow_ruled`` (an active flow rule on its kind
    or tenant), in one query: every decision and write of the claim uses that clock."""
    return Job.objects.annotate(db_now=Now(), flow_ruled=rules.flow_ruled_q()).filter(pk=job_id)


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
