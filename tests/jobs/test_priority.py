"""The claim's order (docs/app/scheduling.md), in-process: priority first, aging against
starvation, and concurrent claims taking different jobs (PostgreSQL, real threads).

The jobs table is the queue: these tests take the queue's next job as a cluster's dequeue
does (the next-job claim, ``jobs.claiming.claims().claim_next``), one worker at a time,
and record which job each delivery ran. No engine job has a ``django_q_ormq`` row. Time
passing is travel: the waiting jobs' due times move into the past.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import F
from django_q.models import OrmQ

import jobs
from jobs import rules
from jobs.delivery import runner
from jobs.models import Job
from jobs.registry import kinds, register_kind
from tests.jobs.helpers import claim_next

KIND = "test.priority"
ran: list[int] = []


def _record(ctx) -> list:
    ran.append(ctx.job.pk)
    return []


if KIND not in kinds():
    register_kind(KIND, _record)


@pytest.fixture(autouse=True)
def _fresh():
    ran.clear()
    yield
    ran.clear()


def ask(name: str, *, priority: int = 0, queue: str = "default") -> Job:
    return jobs.request(KIND, ("priority", name), priority=priority, queue=queue).job


def deliver_next(queue: str = "default") -> int | None:
    """One worker's next delivery: the queue's next job by the claim; the job it ran."""
    claim = claim_next(queue, "w1")
    if claim is None:
        return None
    assert claim.won, claim.status
    before = len(ran)
    runner.run_claim(claim, "w1")
    return ran[before] if len(ran) > before else None


def time_passes(seconds: float) -> None:
    """Every waiting job has waited ``seconds`` longer (its due time moves back)."""
    waited = timedelta(seconds=seconds)
    Job.objects.filter(rules.to_q(rules.WAITING)).update(
        next_attempt_at=F("next_attempt_at") - waited, created_at=F("created_at") - waited
    )


@pytest.mark.django_db
def test_high_priority_asked_after_50_low_starts_at_the_first_claim():
    low = [ask(f"low-{i}", priority=-10) for i in range(50)]
    high = ask("high", priority=10)
    first = deliver_next()
    print(f"first claim: {first} (high={high.pk}, lows {low[0].pk}..{low[-1].pk})")
    assert first == high.pk
    assert not OrmQ.objects.exists(), "the jobs table is the queue: no django_q_ormq row"
    # Every other job still runs once, in due order.
    while deliver_next() is not None:
        pass
    assert ran == [high.pk] + [j.pk for j in low]
    assert Job.objects.filter(kind=KIND).exclude(state=Job.State.SUCCEEDED).count() == 0


@pytest.mark.django_db
def test_equal_priorities_are_claimed_in_due_order():
    asked = [ask(f"same-{i}", priority=3) for i in range(5)]
    order = [deliver_next() for _ in asked]
    assert order == [j.pk for j in asked]
    assert deliver_next() is None


@pytest.mark.django_db
def test_starvation_bound__a_low_job_starts_while_high_work_keeps_arriving(settings):
    """Bound: a job of priority p outranks every fresh job of priority P once it has
    waited (P - p) * JOBS_PRIORITY_AGING_SECONDS; the queue's next claim takes it then
    (no message names another job). Here p=0, P=10, aging 10 s: 100 s of waiting."""
    settings.JOBS_PRIORITY_AGING_SECONDS = 10.0
    step = 2.0  # seconds of waiting per delivery: one new high job arrives each time
    low = ask("low", priority=0)
    bound = (10 - 0) * 10.0
    started_after = None
    for round_ in range(200):
        ask(f"high-{round_}", priority=10)
        if deliver_next() == low.pk:
            started_after = round_ * step
            break
        time_passes(step)
    print(f"the low job started after {started_after} s of waiting (bound {bound} s)")
    assert started_after is not None, "starved"
    assert started_after <= bound + step
    # Priority still counted: it did not just go first in its turn.
    assert started_after >= (10 - 0 - 1) * 10.0


@pytest.mark.django_db
def test_the_next_claim_never_takes_a_job_of_another_queue():
    reports = ask("report", priority=100, queue="reports")
    plain = ask("plain", priority=-100)
    assert deliver_next() == plain.pk
    assert deliver_next() is None, "the reports job is not the default queue's"
    assert deliver_next("reports") == reports.pk


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_claims_take_different_jobs_best_first(settings):
    """Eight next-job claims at once take the eight high jobs, each once (each candidate
    ``FOR UPDATE SKIP LOCKED``: a job another claim holds is passed over)."""
    # Eight threads share one GIL on a loaded host: a claim's transaction may sit idle
    # longer than a 2 s lease's idle timeout (a quarter of it) between its statements.
    settings.JOBS_LEASE_SECONDS = 60
    low = [ask(f"c-low-{i}", priority=0) for i in range(8)]
    high = [ask(f"c-high-{i}", priority=50) for i in range(8)]
    barrier = threading.Barrier(8)

    def claim(i: int) -> int | None:
        try:
            barrier.wait()
            got = claim_next("default", f"w{i}")
            return got.job.pk if got is not None and got.won else None
        finally:
            connection.close()

    with ThreadPoolExecutor(8) as pool:
        taken = list(pool.map(claim, range(8)))
    print(f"taken: {taken}")
    assert len(set(taken)) == 8, taken
    assert sorted(taken) == sorted(j.pk for j in high)
    assert Job.objects.filter(pk__in=[j.pk for j in high], attempts=1).count() == 8
    assert Job.objects.filter(pk__in=[j.pk for j in low], state=Job.State.QUEUED).count() == 8


# The named claim's round trips (``jobs.executors.orm.claim``, issue 30's bench bar): it
# reads the named job alone and never swaps, whatever else its queue holds. PostgreSQL:
# BEGIN; SET LOCAL fences; the read; the claim lock; UPDATE (the CAS); INSERT attempt;
# COMMIT. SQLite: BEGIN IMMEDIATE; the read; UPDATE; INSERT; COMMIT.
NAMED_CLAIM_QUERIES = {"postgresql": 7, "sqlite": 5}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("other_priority", [-5, 5], ids=["less-urgent", "more-urgent"])
def test_named_claim__takes_exactly_its_job_in_a_fixed_number_of_round_trips(other_priority):
    from django.test.utils import CaptureQueriesContext

    from jobs import conf
    from jobs.executors import orm

    named = ask("named", priority=0)
    other = ask("other", priority=other_priority)
    with CaptureQueriesContext(connection) as captured:
        got = orm.claim(named.pk, "w1", lease=60.0, bound=conf.tenant_concurrency())
    sqls = [q["sql"] for q in captured]
    assert got.won and got.job.pk == named.pk, "a named claim never swaps"
    assert Job.objects.get(pk=named.pk).state == Job.State.RUNNING
    assert Job.objects.get(pk=other.pk).state == Job.State.QUEUED
    assert len(sqls) == NAMED_CLAIM_QUERIES[connection.vendor], sqls


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_next_claim_orm__a_job_another_claim_started_since_the_read_is_passed_over(
    monkeypatch,
):
    """The ORM's next-job claim (``ormclaim.claim_next``) reads its candidates before it
    takes the best one's claim lock: a claim that starts that job in between moves its
    version, this claim's start CAS fails, and it takes the queue's next job instead of
    recording a lost race."""
    from jobs import conf
    from jobs.engine import named_claim
    from jobs.executors import ormclaim

    named = ask("next", priority=0)
    urgent = ask("urgent", priority=50)
    real_lock = named_claim._claim_lock
    raced = []

    def lock_after_a_rival(pk: int) -> bool:
        if pk == urgent.pk and not raced:  # a rival claims it first, on its own connection
            raced.append(True)

            def rival():
                try:
                    raced.append(named_claim.claim(urgent.pk, "rival", lease=60.0, bound=10))
                finally:
                    connection.close()

            thread = threading.Thread(target=rival)
            thread.start()
            thread.join(30)
        return real_lock(pk)

    monkeypatch.setattr(named_claim, "_claim_lock", lock_after_a_rival)
    got = ormclaim.claim_next("default", "w1", lease=60.0, bound=conf.tenant_concurrency())
    assert raced[1].won and raced[1].job.pk == urgent.pk  # the rival took the urgent job
    assert got.won and got.job.pk == named.pk  # this claim took the queue's next one
    rows = {j.pk: j for j in Job.objects.filter(pk__in=[named.pk, urgent.pk])}
    assert (rows[urgent.pk].lease_owner, rows[urgent.pk].attempts) == ("rival", 1)
    assert (rows[named.pk].lease_owner, rows[named.pk].attempts) == ("w1", 1)
