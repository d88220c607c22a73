"""``jobs.request_many``: N jobs in one transaction and a fixed number of statements per
batch, with ``jobs.request``'s identity rules (an existing identity returns its handle,
other params raise ``JobConflict``), ``created`` true only for new ones. The jobs table is
the queue: a job's row is all it gets (no ``django_q_ormq`` row), and the call wakes each
queue it asked for once (a NOTIFY on PostgreSQL)."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_q.conf import Conf
from django_q.models import OrmQ

import jobs
from jobs import api, rules
from jobs.api import JobConflict
from jobs.broker import channel_for
from jobs.models import Job
from tests.jobs.helpers import claim_next

KIND = "test.steps"  # tests.testapp's


def _items(n: int, *, start: int = 0, **extra) -> list[dict]:
    return [
        {"kind": KIND, "subject": ("test.bulk", i), "params": {"n": i}, **extra}
        for i in range(start, start + n)
    ]


def _statements(queries) -> Counter:
    return Counter(q["sql"].split(None, 1)[0].upper() for q in queries)


def _claimable() -> list[int]:
    """The jobs a claim may take now, by their rows."""
    due = Job.objects.filter(rules.to_q(rules.CLAIMABLE))
    return sorted(due.values_list("pk", flat=True))


def _notified(queries) -> list[str]:
    """The captured statements that NOTIFY a channel, in order."""
    return [q["sql"] for q in queries if "pg_notify" in q["sql"]]


@pytest.mark.django_db(transaction=True)
def test_request_many__1000_jobs_in_a_few_statements_no_message_the_same_ids_again():
    with CaptureQueriesContext(connection) as first:
        handles = jobs.request_many(_items(1000))
    ids = [h.id for h in handles]
    print(
        f"\n{connection.vendor}: request_many of 1,000 new jobs: {len(first)} statements "
        f"{dict(_statements(first.captured_queries))}"
    )
    assert all(h.created for h in handles) and len(set(ids)) == 1000
    assert [h.job.params["n"] for h in handles] == list(range(1000)), "the order of the items"
    assert Job.objects.count() == 1000
    assert _claimable() == sorted(ids), "each due now on its row"
    assert not OrmQ.objects.exists(), "the jobs table is the queue: no django_q_ormq row"
    assert all(h.job.next_attempt_at is not None for h in handles), "read back after Now()"
    # Per batch of 500, not per job: PostgreSQL one INSERT a batch; SQLite's 999-parameter
    # cap splits the jobs' INSERT (about 28 rows a statement), still far from one per job.
    assert len(first) <= (16 if connection.vendor == "postgresql" else 100), len(first)
    assert not [q for q in first.captured_queries if "django_q_ormq" in q["sql"]]

    with CaptureQueriesContext(connection) as again:
        repeated = jobs.request_many(_items(1000))
    print(f"{connection.vendor}: the same 1,000 again: {len(again)} statements")
    assert [h.id for h in repeated] == ids
    assert not any(h.created for h in repeated)
    assert _notified(again.captured_queries) == [], "nothing new: no queue is woken"
    assert len(again) <= 4


@pytest.mark.django_db(transaction=True)
def test_request_many__one_transaction_a_failure_leaves_nothing(monkeypatch):
    """The second batch's wake-up fails: the first batch's jobs go too."""
    calls = []
    real = api.enqueue_jobs

    def failing(jobs_, **kwargs):
        jobs_ = list(jobs_)
        if jobs_:
            calls.append(len(jobs_))
        if len(calls) == 2:
            raise RuntimeError("the queue refused")
        return real(jobs_, **kwargs)

    monkeypatch.setattr(api, "enqueue_jobs", failing)
    with pytest.raises(RuntimeError):
        jobs.request_many(_items(30), batch_size=20)
    assert calls == [20, 10]
    assert not Job.objects.exists() and not OrmQ.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_request_many__each_job_is_claimed_from_its_own_queue(settings):
    """As ``jobs.request`` routes it: a ``reports`` job is claimed by the reports queue's
    claim only, and nothing is written to ``django_q_ormq``."""
    settings.JOBS_LEASE_SECONDS = 60  # claimed, not run
    reports, default = jobs.request_many(
        [{**_items(1)[0], "queue": "reports"}, _items(1, start=1)[0]]
    )
    assert (reports.job.queue, default.job.queue) == ("reports", "default")
    assert not OrmQ.objects.exists()
    claim = claim_next("default")
    assert claim.won and claim.job.pk == default.id
    assert claim_next("default") is None, "the reports job is not the default queue's"
    claim = claim_next("reports")
    assert claim.won and claim.job.pk == reports.id


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_request_many__one_notify_per_queue_it_asked_for():
    """The wake-up of the clusters serving each queue (``jobs.queue.notify_queues``): one
    per queue and call, not one per job; a ``reports`` job wakes the reports queue's."""
    with CaptureQueriesContext(connection) as q:
        jobs.request_many(_items(50) + _items(10, start=50, queue="reports"))
    notifies = _notified(q.captured_queries)
    assert len(notifies) == 2, notifies
    channels = {channel_for(Conf.CLUSTER_NAME), channel_for(f"{Conf.PREFIX}.reports")}
    assert all(any(c in sql for c in channels) for sql in notifies), (notifies, channels)
    assert not OrmQ.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_request_many__existing_jobs_are_returned_and_other_params_conflict():
    earlier = jobs.request(KIND, ("test.bulk", 1), params={"n": 1})
    handles = jobs.request_many(_items(3))
    assert [h.created for h in handles] == [True, False, True]
    assert handles[1].id == earlier.id
    assert Job.objects.count() == 3 and not OrmQ.objects.exists()

    with pytest.raises(JobConflict, match="keys differing: n"):
        jobs.request_many([*_items(2, start=10), {**_items(1)[0], "params": {"n": 99}}])
    assert not Job.objects.filter(subject_id__in=["10", "11"]).exists(), "nothing of the call"


@pytest.mark.django_db(transaction=True)
def test_request_many__one_identity_twice_in_a_call():
    same = _items(1) * 2
    first, second = jobs.request_many(same)
    assert first.id == second.id and (first.created, second.created) == (True, False)
    assert Job.objects.count() == 1 and not OrmQ.objects.exists()
    with pytest.raises(JobConflict, match="twice with different params"):
        jobs.request_many([*_items(1, start=5), {**_items(1, start=5)[0], "params": {"n": 0}}])
    assert not Job.objects.filter(subject_id="5").exists()


@pytest.mark.django_db(transaction=True)
def test_request_many__run_after_waits_on_its_row_and_the_kind_defaults_apply():
    later = timezone.now() + timedelta(hours=1)
    items = [
        api.JobRequest(KIND, ("test.bulk", 1), run_after=later, tenant="t9", priority=7),
        {"kind": KIND, "subject": ("test.bulk", 2), "queue": "default"},
    ]
    delayed, now = jobs.request_many(items)
    assert _claimable() == [now.id], "the delayed one is not due yet"
    delayed.refresh()
    assert delayed.job.next_attempt_at == later and delayed.job.state == Job.State.QUEUED
    assert (delayed.job.tenant_key, delayed.job.priority) == ("t9", 7)
    assert now.job.max_attempts == jobs.request(KIND, ("test.other", 1)).job.max_attempts
    assert not OrmQ.objects.exists()
    with pytest.raises(ValueError, match="aware"):
        jobs.request_many([{**items[1], "run_after": later.replace(tzinfo=None)}])


@pytest.mark.django_db(transaction=True)
def test_request_many__run_after_jobs_are_claimed_at_their_due_time_not_before(settings):
    """50 jobs asked for an hour from now and one for now: a claim takes the due one only;
    once their time has come (moved here to the past) each is claimed, once."""
    settings.JOBS_LEASE_SECONDS = 60  # claimed, not run
    later = timezone.now() + timedelta(hours=1)
    items = [api.JobRequest(KIND, ("test.bulk", n), run_after=later) for n in range(50)]
    items.append(api.JobRequest(KIND, ("test.bulk", 99)))
    handles = jobs.request_many(items)
    assert not OrmQ.objects.exists()
    first = claim_next()
    assert first.won and first.job.pk == handles[50].id
    assert claim_next() is None, "the 50 wait for their time"
    Job.objects.filter(pk__in=[h.id for h in handles[:50]]).update(
        next_attempt_at=Now() - timedelta(seconds=1)
    )
    taken = []
    while (claim := claim_next()) is not None:
        assert claim.won
        taken.append(claim.job.pk)
    assert sorted(taken) == sorted(h.id for h in handles[:50])


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_request_many__two_callers_racing_create_each_job_once():
    """Both ask for the same 300 identities at once: one INSERT wins each identity, the
    other waits on the unique index, fails whole, reads again and returns those jobs."""
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def ask(n: int) -> None:
        try:
            barrier.wait(10)
            results[n] = jobs.request_many(_items(300), batch_size=100)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=ask, args=(n,)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    a, b = results[1], results[2]
    assert [h.id for h in a] == [h.id for h in b]
    assert [x.created + y.created for x, y in zip(a, b, strict=True)] == [1] * 300
    assert Job.objects.count() == 300
    assert _claimable() == sorted(h.id for h in a), "one row per job, each due once"
    assert not OrmQ.objects.exists()
