"""The claim's order (docs/app/scheduling.md), in-process: priority first, aging against
starvation, and concurrent claims taking different jobs (PostgreSQL, real threads).

A message names a job and wakes its queue: these tests deliver the queue's messages in
broker order (``OrmQ`` by id), as one worker would, and record which job each delivery
ran. Time passing is travel: the waiting jobs' due times move into the past.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import F
from django_q.models import OrmQ
from django_q.signing import SignedPackage

import jobs
from jobs import rules
from jobs.delivery import runner
from jobs.models import Job
from jobs.registry import kinds, register_kind

# These promises are about queue messages (jobs.queue, jobs.bulk, jobs.dispatch).
pytestmark = pytest.mark.usefixtures("message_broker")

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


def next_message() -> int | None:
    """Take the oldest job message of the queue (broker order) and return the job it names."""
    for message in OrmQ.objects.order_by("id"):
        task = SignedPackage.loads(message.payload)
        message.delete()
        if task.get("func") == "jobs.tasks.run_job":
            return task["args"][0]
    return None


def deliver_next() -> int | None:
    """One worker's next delivery: the oldest message; returns the job it ran, if any."""
    named = next_message()
    assert named is not None, "a due job without a message"
    before = len(ran)
    runner.run_delivery(named, worker="w1")
    return ran[before] if len(ran) > before else None


def time_passes(seconds: float) -> None:
    """Every waiting job has waited ``seconds`` longer (its due time moves back)."""
    waited = timedelta(seconds=seconds)
    Job.objects.filter(rules.to_q(rules.WAITING)).update(
        next_attempt_at=F("next_attempt_at") - waited, created_at=F("created_at") - waited
    )


@pytest.mark.django_db
def test_high_priority_asked_after_50_low_starts_within_the_first_2_claims():
    low = [ask(f"low-{i}", priority=-10) for i in range(50)]
    high = ask("high", priority=10)
    first_two = [deliver_next(), deliver_next()]
    print(f"first two claims: {first_two} (high={high.pk}, lows {low[0].pk}..{low[-1].pk})")
    assert high.pk in first_two
    # Every other job still runs once, each with a message of its own.
    while OrmQ.objects.exists():
        deliver_next()
    assert sorted(ran) == sorted([j.pk for j in low] + [high.pk])
    assert Job.objects.filter(kind=KIND).exclude(state=Job.State.SUCCEEDED).count() == 0


@pytest.mark.django_db
def test_equal_priorities_keep_their_message_order():
    asked = [ask(f"same-{i}", priority=3) for i in range(5)]
    order = [deliver_next() for _ in asked]
    assert order == [j.pk for j in asked]


@pytest.mark.django_db
def test_starvation_bound__a_low_job_starts_while_high_work_keeps_arriving(settings):
    """Bound: a job of priority p outranks every fresh job of priority P once it has
    waited (P - p + SWAP_MARGIN) * JOBS_PRIORITY_AGING_SECONDS; it starts at the next
    delivery of its queue then. Here p=0, P=10, aging 10 s: 110 s of waiting."""
    settings.JOBS_PRIORITY_AGING_SECONDS = 10.0
    step = 2.0  # seconds of waiting per delivery: one new high job arrives each time
    low = ask("low", priority=0)
    bound = (10 - 0 + rules.SWAP_MARGIN) * 10.0
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
def test_a_delivery_never_claims_a_job_of_another_queue():
    reports = ask("report", priority=100, queue="reports")
    plain = ask("plain", priority=-100)
    assert runner.claim_for(plain.pk, "w1").job.pk == plain.pk
    # The reports job's own message, delivered by a worker: it is the only one there.
    assert runner.claim_for(reports.pk, "w2").job.pk == reports.pk


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_claims_take_different_jobs_best_first(settings):
    """Eight claims at once, each named by a low job's message: they take the eight high
    jobs, each once (the statement's swap, then the ORM claim's SKIP LOCKED)."""
    # Eight threads share one GIL on a loaded host: a claim's transaction may sit idle
    # longer than a 2 s lease's idle timeout (a quarter of it) between its statements.
    settings.JOBS_LEASE_SECONDS = 60
    low = [ask(f"c-low-{i}", priority=0) for i in range(8)]
    high = [ask(f"c-high-{i}", priority=50) for i in range(8)]
    barrier = threading.Barrier(8)

    def claim(i: int) -> int | None:
        try:
            barrier.wait()
            got = runner.claim_for(low[i].pk, f"w{i}")
            return got.job.pk if got.won else None
        finally:
            connection.close()

    with ThreadPoolExecutor(8) as pool:
        taken = list(pool.map(claim, range(8)))
    print(f"taken: {taken}")
    assert len(set(taken)) == 8, taken
    assert sorted(taken) == sorted(j.pk for j in high)
    assert Job.objects.filter(pk__in=[j.pk for j in high], attempts=1).count() == 8


# The ORM claim's round trips, swapping or not (issue 30's bench bar): the queue's two
# candidates come whole with the named job's row, so taking one of them reads nothing
# more. PostgreSQL: BEGIN; SET LOCAL fences; the read; the claim lock (of the named job,
# or of the candidate taken, then its version again in a statement of its own, whose
# snapshot is newer than the lock); UPDATE (the CAS); INSERT attempt; COMMIT.
# SQLite: BEGIN IMMEDIATE; the read; UPDATE; INSERT; COMMIT (the write lock is held
# since the read: a recheck could see nothing new).
ORM_CLAIM_QUERIES = {"postgresql": (7, 7), "sqlite": (5, 5)}  # (keeps its job, swaps)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("swaps", [False, True], ids=["keeps", "swaps"])
def test_orm_claim__a_swap_costs_no_round_trip(swaps):
    from django.test.utils import CaptureQueriesContext

    from jobs import conf
    from jobs.executors import orm

    named = ask("named", priority=0)
    other = ask("other", priority=5 if swaps else -5)
    with CaptureQueriesContext(connection) as captured:
        got = orm.claim(named.pk, "w1", lease=60.0, bound=conf.tenant_concurrency())
    sqls = [q["sql"] for q in captured]
    assert got.won and got.job.pk == (other.pk if swaps else named.pk)
    assert Job.objects.get(pk=got.job.pk).state == Job.State.RUNNING
    assert len(sqls) == ORM_CLAIM_QUERIES[connection.vendor][swaps], sqls


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_orm_claim__a_swapped_job_another_claim_started_since_the_read_is_passed_over(
    monkeypatch,
):
    """The candidate is read before its claim lock is taken: a claim that starts it in
    between moves its version, this claim's start CAS fails, and it chooses again (its
    named job) instead of recording a lost race and leaving a job without a delivery."""
    from jobs import conf
    from jobs.engine import named_claim as orm

    named = ask("named", priority=0)
    urgent = ask("urgent", priority=50)
    real_lock = orm._claim_lock
    raced = []

    def lock_after_a_rival(pk: int) -> bool:
        if pk == urgent.pk and not raced:  # a rival claims it first, on its own connection
            raced.append(True)

            def rival():
                try:
                    raced.append(orm.claim(urgent.pk, "rival", lease=60.0, bound=10))
                finally:
                    connection.close()

            thread = threading.Thread(target=rival)
            thread.start()
            thread.join(30)
        return real_lock(pk)

    monkeypatch.setattr(orm, "_claim_lock", lock_after_a_rival)
    got = orm.claim(named.pk, "w1", lease=60.0, bound=conf.tenant_concurrency())
    assert raced[1].won and raced[1].job.pk == urgent.pk  # the rival took the urgent job
    assert got.won and got.job.pk == named.pk  # this delivery ran its own named job
    rows = {j.pk: j for j in Job.objects.filter(pk__in=[named.pk, urgent.pk])}
    assert (rows[urgent.pk].lease_owner, rows[urgent.pk].attempts) == ("rival", 1)
    assert (rows[named.pk].lease_owner, rows[named.pk].attempts) == ("w1", 1)
