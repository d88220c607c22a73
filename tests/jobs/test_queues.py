"""Routed queues (docs/app/scheduling.md): a job's messages go to its queue's django-q2
list, a worker started with ``--queue`` takes only those lists, the dispatcher re-drives
each job on its own queue, and a ``queue:<name>`` flow rule holds at every claim."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django_q.conf import Conf
from django_q.models import OrmQ
from django_q.signing import SignedPackage

import jobs
from jobs import flow, queue, rules
from jobs.broker import OrmQueues
from jobs.delivery import runner
from jobs.dispatch import dispatch_once
from jobs.models import Job
from jobs.registry import kinds, register_kind
from jobs.supervisor import Options, Supervisor
from tests.jobs.helpers import make_due

# These promises are about queue messages (jobs.queue, jobs.bulk, jobs.dispatch).
pytestmark = pytest.mark.usefixtures("message_broker")

KIND = "test.queues"

if KIND not in kinds():
    register_kind(KIND, lambda ctx: [], queue="reports")

REPORTS = f"{Conf.PREFIX}.reports"


def ask(name: str, **options) -> Job:
    return jobs.request(KIND, ("queues", name), **options).job


def messages() -> list[tuple[str, int]]:
    """(list key, job id) of every job message, oldest first."""
    out = []
    for m in OrmQ.objects.order_by("id"):
        task = SignedPackage.loads(m.payload)
        if task.get("func") == "jobs.tasks.run_job":
            out.append((m.key, task["args"][0]))
    return out


@pytest.mark.django_db
def test_a_jobs_message_goes_to_its_queues_list():
    report = ask("r1")  # the kind's queue
    plain = ask("p1", queue="default")
    other = ask("o1", queue="fast.lane")
    assert report.queue == "reports"
    assert messages() == [
        (REPORTS, report.pk),
        (Conf.CLUSTER_NAME, plain.pk),
        (f"{Conf.PREFIX}.fast.lane", other.pk),
    ]
    assert queue.list_key("default") is None  # django-q2's own list, as before queues
    assert queue.serving_keys(["reports", "default", "reports"]) == [REPORTS, Conf.CLUSTER_NAME]


@pytest.mark.django_db
def test_the_dispatcher_redrives_each_job_on_its_own_queue():
    report = ask("r2")
    plain = ask("p2", queue="default")
    OrmQ.objects.all().delete()  # the messages were lost
    for job in (report, plain):
        Job.objects.filter(pk=job.pk).update(state=Job.State.RETRY_WAIT)
        make_due(job)
    sent = dispatch_once()
    assert sent["due_jobs"] == 2
    assert sorted(messages()) == sorted([(REPORTS, report.pk), (Conf.CLUSTER_NAME, plain.pk)])


@pytest.mark.django_db
def test_a_worker_for_some_queues_takes_only_their_messages(settings):
    report, plain, other = ask("r3"), ask("p3", queue="default"), ask("o3", queue="other")
    served = OrmQueues(list_key=REPORTS, keys=[REPORTS, Conf.CLUSTER_NAME])
    taken = []
    while batch := served.dequeue():
        taken += [SignedPackage.loads(payload)["args"][0] for _, payload in batch]
    assert sorted(taken) == sorted([report.pk, plain.pk])
    assert other.pk not in taken
    assert served.queue_size() == 0 and served.lock_size() == 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)  # the broker reads now(): its own transaction's
def test_the_postgres_broker_serves_several_lists():
    from jobs.broker import PostgresBroker

    report, plain, other = ask("r4"), ask("p4", queue="default"), ask("o4", queue="other")
    served = PostgresBroker(list_key=REPORTS, keys=[REPORTS, Conf.CLUSTER_NAME])
    taken: list[int] = []
    for _ in range(100):  # bulk may be 1 a take; the server's clock passes each lock
        taken += [SignedPackage.loads(payload)["args"][0] for _, payload in served._take()]
        if len(taken) >= 2:
            break
        time.sleep(0.02)
    assert sorted(taken) == sorted([report.pk, plain.pk]), taken
    assert not served._take(), "nothing of another list"
    assert other.pk not in taken
    assert served.lock_size() == 2


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
