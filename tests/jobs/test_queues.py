"""Routed queues (docs/app/scheduling.md): a job's row names its queue, a worker started
with ``--queue`` claims only those queues' jobs (the jobs table is the queue: no message),
a due retry is claimed on its own queue, and a ``queue:<name>`` flow rule holds at every
claim."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django_q.conf import Conf
from django_q.models import OrmQ

import jobs
from jobs import flow, queue, rules
from jobs.delivery import runner
from jobs.models import Job
from jobs.registry import kinds, register_kind
from jobs.supervisor import Options, Supervisor
from tests.jobs.helpers import claim_next, make_due

KIND = "test.queues"

if KIND not in kinds():
    register_kind(KIND, lambda ctx: [], queue="reports")

REPORTS = f"{Conf.PREFIX}.reports"


def ask(name: str, **options) -> Job:
    return jobs.request(KIND, ("queues", name), **options).job


def claimed_from(queue_name: str, worker: str = "w1") -> list[int]:
    """Every job ``queue_name``'s next-job claim takes, in order, until none is due."""
    out = []
    while (claim := claim_next(queue_name, worker)) is not None:
        assert claim.won, claim.status
        out.append(claim.job.pk)
    return out


@pytest.mark.django_db
def test_queue__a_job_names_its_queue_on_its_row_and_has_no_message():
    report = ask("r1")  # the kind's queue
    plain = ask("p1", queue="default")
    other = ask("o1", queue="fast.lane")
    assert [j.queue for j in (report, plain, other)] == ["reports", "default", "fast.lane"]
    assert not OrmQ.objects.exists(), "the jobs table is the queue: no django_q_ormq row"
    assert queue.list_key("default") is None  # django-q2's own list, as before queues
    assert queue.list_key("reports") == REPORTS
    assert queue.serving_keys(["reports", "default", "reports"]) == [REPORTS, Conf.CLUSTER_NAME]


@pytest.mark.django_db
def test_queue__a_due_retry_is_claimed_on_its_own_queue_only():
    report = ask("r2")
    plain = ask("p2", queue="default")
    for job in (report, plain):
        Job.objects.filter(pk=job.pk).update(state=Job.State.RETRY_WAIT)
        make_due(job)
    assert claimed_from("other") == []
    assert claimed_from("default") == [plain.pk]
    assert claimed_from("reports") == [report.pk]
    assert not OrmQ.objects.exists()


@pytest.mark.django_db
def test_queue__a_worker_for_some_queues_claims_only_their_jobs(settings):
    settings.JOBS_LEASE_SECONDS = 60  # claimed and not run
    report, plain, other = ask("r3"), ask("p3", queue="default"), ask("o3", queue="other")
    taken = claimed_from("reports") + claimed_from("default")
    assert sorted(taken) == sorted([report.pk, plain.pk])
    assert Job.objects.get(pk=other.pk).state == Job.State.QUEUED, "another queue's: left"
    assert claimed_from("other") == [other.pk]
    assert not OrmQ.objects.exists()


def test_jobs_worker_queue_option():
    with pytest.raises(CommandError, match="--queue 'no spaces'"):
        call_command("jobs_worker", "--queue", "no spaces")
    supervised = Supervisor(Options(stall_seconds=30, queues=("reports", "default")))
    assert supervised.command[-3:] == ["jobs_worker", "--serve-queues", "reports,default"]
    assert Supervisor(Options(stall_seconds=30)).command[-1] == "qcluster"


@pytest.mark.django_db
def test_queue_rule_concurrency_1__the_second_claim_is_deferred():
    flow.set_rule("queue:reports", actor="test", concurrency=1)
    first, second, plain = ask("r5"), ask("r6"), ask("p5", queue="default")
    assert runner.claim_for(first.pk, "w1").status == "claimed"
    held = runner.claim_for(second.pk, "w2")
    assert held.status == "deferred" and held.job.pk == second.pk
    assert runner.claim_for(plain.pk, "w3").status == "claimed", "other queues flow"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_queue_rule_concurrency_1_holds_under_concurrent_claims(settings):
    settings.JOBS_LEASE_SECONDS = 60  # eight threads, one GIL: no idle timeout mid-claim
    flow.set_rule(rules.queue_scope("reports"), actor="test", concurrency=1)
    batch = [ask(f"r-c{i}", priority=i % 3) for i in range(8)]
    barrier = threading.Barrier(8)

    def claim(i: int) -> str:
        try:
            barrier.wait()
            return runner.claim_for(batch[i].pk, f"w{i}").status
        finally:
            connection.close()

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(claim, range(8)))
    assert statuses.count("claimed") == 1, statuses
    live = Job.objects.filter(rules.to_q(rules.LIVE_RUNNING), queue="reports").count()
    assert live == 1
