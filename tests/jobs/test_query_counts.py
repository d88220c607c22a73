"""Pinned round trips and commits of the hot path: a regression (or an improvement) fails here.

These tests run outside a test transaction (``transaction=True``), as a worker does:
Django logs BEGIN and COMMIT, so every entry counted is one round trip to the
database, and a statement sent in autocommit mode is its own transaction and
commit. When a change to the engine moves a number on purpose, update it here
together with the comment that says which statement went away or came in, and the
figures in docs/benchmarks.md.

On PostgreSQL the jobs table is the queue: the cluster's pusher claims the next job
in one statement (``jobs.executors.pgclaim``), the worker adopts it with one read, and
the publish is one statement. SQLite takes the ORM path (a message names the job): its
claim and publish are ORM transactions.
"""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobs import conf
from jobs.delivery.runner import run_adopted, run_delivery
from jobs.executors import pgclaim
from jobs.models import Attempt, Effect, Job, Notice
from tests.jobs.helpers import new_job, request_job, scans_of

pytestmark = pytest.mark.django_db(transaction=True)

WRITE = re.compile(r"^\s*(INSERT|UPDATE|DELETE)\b|^\s*WITH\b.*\b(INSERT|UPDATE)\b", re.I | re.S)


def commits(sqls: list[str]) -> int:
    """COMMITs, plus writes sent in autocommit mode (each its own durable transaction)."""
    count, in_tx = 0, False
    for sql in sqls:
        if sql.startswith("BEGIN"):
            in_tx = True
        elif sql == "COMMIT":
            count, in_tx = count + 1, False
        elif not in_tx and WRITE.match(sql):
            count += 1
    return count


def trace(fn):
    with CaptureQueriesContext(connection) as captured:
        result = fn()
    return result, [q["sql"] for q in captured]


# request_job: create the job and wake its queue in one transaction.
#   BEGIN
#   SELECT jobs_job by (kind, subject, revision)   -- get_or_create: is it there?
#   SAVEPOINT                                      -- get_or_create's create
#   INSERT jobs_job
#   RELEASE SAVEPOINT
#   SELECT jobs_archivedjob by the identity        -- issue 46: archived? then roll back
#   NOTIFY the queue's channel                     -- PostgreSQL: the jobs table is the queue
#                                                   (no django_q_ormq row; SQLite: nothing,
#                                                   an idle cluster polls)
#   SELECT next_attempt_at                         -- written by the server's clock (issue 10)
#   COMMIT
REQUEST_JOB = {"postgresql": (9, 1), "sqlite": (8, 1)}

# One test.steps job (no private read) with one in-app recipient through a worker.
# PostgreSQL, 4 round trips, 2 commits:
#   WITH t, by_priority, by_wait, picked, locked, judged, claimed (UPDATE jobs_job),
#       attempt (INSERT)                            -- the pusher's claim of the queue's
#                                                   next job (autocommit; issue 41)
#   SELECT jobs_attempt JOIN jobs_job               -- the worker adopts the claim: one read,
#                                                   also its connection's check (no SELECT 1)
#   SELECT 1 jobs_job still owned                   -- the one ownership check (check_owner)
#   WITH refused_recipient AS (...), job AS (UPDATE jobs_job ...) ...   -- the publish: the
#                                                   recipient still active, CAS, artifact row,
#                                                   effect, notice, event, attempt outcome
# (Issue 12 took the message path from 24 round trips, 3 commits to 3 and 2; the one queue
#  adds the adoption's read and drops the message's row, its lock and its deletion.)
# SQLite: the ORM claim (BEGIN; SELECT; COUNT; UPDATE; INSERT; COMMIT), the check, the
# recheck, the ORM publish (BEGIN; UPDATE; INSERT artifact in a savepoint; INSERT effect;
# the notice in a savepoint; UPDATE effect ref; INSERT event; UPDATE attempt; COMMIT).
RUN_DELIVERY = {"postgresql": (4, 2), "sqlite": (17, 2)}

# demo.summary (the site's minimal kind, the one make bench measures) reads its user too,
# and that read is the ownership check (``ctx.read``: the user's SELECT ... WHERE EXISTS
# (the job still held)), so it costs no round trip more than test.steps (issue 29: 4 → 3).
MINIMAL_DELIVERY = {"postgresql": (4, 2), "sqlite": (17, 2)}

# A second delivery of a finished job by name (``run_delivery``: django-q2's ``sync``, a
# drill, a message left by an older version): recorded, nothing else happens. The named
# claim reads the one job and records why: BEGIN; SET LOCAL fences (PostgreSQL); SELECT
# jobs_job (that job alone, ``named_claim._read``); INSERT jobs_attempt
# (duplicate_delivery); COMMIT. (Before issue 41 PostgreSQL first ran a one-statement
# claim of the named job that picked nothing: 6 round trips, 2 commits.)
DUPLICATE_DELIVERY = {"postgresql": (6, 1), "sqlite": (4, 1)}


def deliver(job: Job):
    """One job's way through a worker, as its database's broker hands it: on PostgreSQL the
    pusher's claim and the worker's adoption (``run_adopted``); on SQLite the delivery by
    name (``run_delivery``: the ORM claim, as the counts above list it)."""
    if connection.vendor != "postgresql":
        return run_delivery(job.pk, worker="w1")
    claim = pgclaim.claim_next(job.queue, "w1", lease=30.0, bound=conf.tenant_concurrency())
    assert claim.won and claim.job.pk == job.pk
    return run_adopted(job.pk, "w1", claim.attempt.pk, claim.job.version)


def test_request_job__round_trips_and_commits(make_user):
    user = make_user()
    job, sqls = trace(lambda: new_job(user))
    assert job.state == Job.State.QUEUED
    assert (len(sqls), commits(sqls)) == REQUEST_JOB[connection.vendor], sqls


def test_run_delivery__round_trips_and_commits(make_user):
    user = make_user()
    job = new_job(user)
    result, sqls = trace(lambda: deliver(job))
    assert result.outcome == Attempt.Outcome.SUCCEEDED
    assert (len(sqls), commits(sqls)) == RUN_DELIVERY[connection.vendor], sqls
    assert Effect.objects.get(job=job).state == Effect.State.APPLIED
    assert Notice.objects.filter(effect__job=job, recipient=user).count() == 1
    assert job.artifacts.count() == 1


def test_minimal_kind__round_trips_and_commits(make_user):
    user = make_user()
    job, _ = request_job(
        "demo.summary",
        subject_type="bench.item",
        subject_id="counts-1",
        tenant_key="bench",
        params={"notify_user_id": user.pk},
    )
    result, sqls = trace(lambda: deliver(job))
    assert result.outcome == Attempt.Outcome.SUCCEEDED
    assert (len(sqls), commits(sqls)) == MINIMAL_DELIVERY[connection.vendor], sqls
    if connection.vendor == "postgresql":  # the bar is production's; SQLite takes the ORM path
        assert len(sqls) <= 8 and commits(sqls) <= 2, "issue 12's bar for a minimal delivery"
        assert not [q for q in sqls if "django_q_ormq" in q], "an engine job has no message"


def test_run_delivery__duplicate_round_trips(make_user):
    user = make_user()
    job = new_job(user)
    run_delivery(job.pk, worker="w1")
    result, sqls = trace(lambda: run_delivery(job.pk, worker="w2"))
    assert result.outcome == "duplicate"
    assert (len(sqls), commits(sqls)) == DUPLICATE_DELIVERY[connection.vendor], sqls
    assert Attempt.objects.filter(job=job, outcome=Attempt.Outcome.DUPLICATE_DELIVERY).count() == 1


def _queue_of(n: int) -> int:
    """``n`` queued jobs of one queue, the table analyzed; the last one's id."""
    import jobs

    handles = jobs.request_many(
        [
            {"kind": "test.steps", "subject": ("auth.user", k), "params": {"recipients": []}}
            for k in range(n)
        ]
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")
    return handles[-1].id


@pytest.mark.postgres
def test_claim_statement__reads_a_handful_of_rows_however_deep_the_queue():
    """The claim's choice of job (the queue's most urgent and longest waiting due job)
    is the first row of an index scan each: with 2,000 jobs queued, no scan of the job
    table hands up more than a few rows (a plan that sorts the queue's due jobs reads
    them all: 6,000 rows and 9 ms a claim with 6,000 queued)."""
    _queue_of(2000)
    sql, params = pgclaim.next_statement("default", "w1", lease=30, bound=4)
    scans = scans_of(sql, params)
    assert scans and max(rows for _, _, rows in scans) <= 5, scans


@pytest.mark.postgres
def test_delivery__every_engine_statement_stays_in_psycopgs_parse_cache(make_user, monkeypatch):
    """psycopg keeps a statement's parsed form only up to 4 KiB (and 50 parameters); a
    longer claim or publish is split and converted again on every delivery (0.15 ms of
    CPU each, measured: both had grown past it)."""
    from psycopg import _queries

    uncached = []
    real = _queries._query2pg_nocache

    def spy(query, *args, **kwargs):
        uncached.append((len(query), bytes(query[:40])))
        return real(query, *args, **kwargs)

    monkeypatch.setattr(_queries, "_query2pg_nocache", spy)
    user = make_user()
    job = new_job(user, kind="test.steps")
    assert deliver(job).outcome == "succeeded"
    assert uncached == [], f"longer than {_queries.MAX_CACHED_STATEMENT_LENGTH} bytes"


@pytest.mark.postgres
def test_orm_claims__read_a_handful_of_rows_however_deep_the_queue():
    """The ORM's reads (the next-job claim's two candidates, ``named_claim._candidates``:
    the queue's best due job by priority and its longest waiting one; the named claim's
    one-row read, ``named_claim._read``) are index scans too: with 2,000 jobs queued, no
    scan of the job table hands up more than a few rows."""
    from jobs import rules
    from jobs.engine import named_claim

    last = _queue_of(2000)
    due = Job.objects.filter(rules.to_q(rules.CLAIMABLE), queue="default")
    reads = {
        "by_priority": due.order_by(*named_claim._BY_PRIORITY)[:1],
        "by_wait": due.order_by(*named_claim._BY_WAIT)[:1],
        "named": named_claim._read(last),
    }
    for name, read in reads.items():
        scans = scans_of(*read.query.sql_with_params())
        assert scans and max(rows for _, _, rows in scans) <= 5, (name, scans)
    assert [j.pk for j in named_claim._candidates("default", exclude=set())]


@pytest.mark.postgres
def test_next_claim__a_paused_scope_of_10000_jobs__is_not_read(make_user):
    """10,000 jobs of a paused kind wait in the queue: the claim of another kind's job
    reads a handful of rows (the pause holds them out of the claim's indexes, ``held_by``)
    and defers none of them. (Before the hold, each claim picked a paused job first,
    deferred it for about a second, and came back to it: the queue's other work waited
    behind the whole paused backlog.)"""
    from jobs import flow

    _queue_of(10_000)
    flow.pause("kind:test.steps", actor="test")
    other = new_job(make_user(), kind="test.short")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")
    sql, params = pgclaim.next_statement("default", "w1", lease=30, bound=4)
    scans = scans_of(sql, params)
    print(f"job-table scans with 10,000 held: {scans}")
    assert scans and max(rows for _, _, rows in scans) <= 5, scans
    claim = pgclaim.claim_next("default", "w1", lease=30, bound=4)
    assert claim.won and claim.job.pk == other.pk
    assert not Attempt.objects.filter(outcome=Attempt.Outcome.DEFERRED).exists()
    assert Job.objects.filter(held_by="kind:test.steps").count() == 10_000
