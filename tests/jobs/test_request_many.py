"""``jobs.request_many``: N jobs and their messages in one transaction and a fixed number of
statements per batch, with ``jobs.request``'s identity rules (an existing identity returns
its handle, other params raise ``JobConflict``), ``created`` true only for new ones."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_q.conf import Conf
from django_q.models import OrmQ

import jobs
from jobs import api, bulk, queue
from jobs.api import JobConflict
from jobs.models import Job

# These promises are about queue messages (jobs.queue, jobs.bulk, jobs.dispatch).
pytestmark = pytest.mark.usefixtures("message_broker")

KIND = "test.steps"  # tests.testapp's


def _items(n: int, *, start: int = 0, **extra) -> list[dict]:
    return [
        {"kind": KIND, "subject": ("test.bulk", i), "params": {"n": i}, **extra}
        for i in range(start, start + n)
    ]


def _statements(queries) -> Counter:
    return Counter(q["sql"].split(None, 1)[0].upper() for q in queries)


def _message_ids() -> list[int]:
    return sorted(task["args"][0] for task in (m.task for m in OrmQ.objects.all()))


@pytest.mark.django_db(transaction=True)
def test_request_many__1000_jobs_in_a_few_statements_1000_messages_the_same_ids_again():
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
    assert _message_ids() == sorted(ids)
    assert all(h.job.next_attempt_at is not None for h in handles), "read back after Now()"
    # Per batch of 500, not per job: PostgreSQL one INSERT a batch; SQLite's 999-parameter
    # cap splits the jobs' INSERT (about 28 rows a statement), still far from one per job.
    assert len(first) <= (16 if connection.vendor == "postgresql" else 100), len(first)

    with CaptureQueriesContext(connection) as again:
        repeated = jobs.request_many(_items(1000))
    print(f"{connection.vendor}: the same 1,000 again: {len(again)} statements")
    assert [h.id for h in repeated] == ids
    assert not any(h.created for h in repeated)
    assert OrmQ.objects.count() == 1000, "no second message for an existing job"
    assert len(again) <= 4


@pytest.mark.django_db(transaction=True)
def test_request_many__one_transaction_a_failure_leaves_nothing(monkeypatch):
    """The second batch's messages fail: the first batch's jobs and messages go too."""
    calls = []
    real = bulk.enqueue_jobs

    def failing(jobs_):
        calls.append(len(jobs_))
        if len(calls) == 2:
            raise RuntimeError("the broker refused")
        return real(jobs_)

    monkeypatch.setattr(bulk, "enqueue_jobs", failing)
    with pytest.raises(RuntimeError):
        jobs.request_many(_items(30), batch_size=20)
    assert calls == [20, 10]
    assert not Job.objects.exists() and not OrmQ.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_request_many__its_messages_are_what_enqueue_job_sends():
    (one,) = jobs.request_many(_items(1))
    (many,) = [m.task for m in OrmQ.objects.all()]
    single = jobs.request(KIND, ("test.single", 1), params={"n": 1})
    (alone,) = [m.task for m in OrmQ.objects.all() if m.task["args"] == (single.id,)]
    assert many["args"] == (one.id,) and many["name"] == f"job-{one.id}"
    assert many["id"] != alone["id"]
    ignored = {"id", "name", "args", "started"}
    assert {k: v for k, v in many.items() if k not in ignored} == {
        k: v for k, v in alone.items() if k not in ignored
    }
    keys = set(OrmQ.objects.values_list("key", flat=True))
    assert keys == {Conf.CLUSTER_NAME} or len(keys) == 1


@pytest.mark.django_db(transaction=True)
def test_request_many__each_message_goes_to_its_queues_list():
    """As ``enqueue_job`` routes it: a ``reports`` job's message on the reports list."""
    reports, default = jobs.request_many(
        [{**_items(1)[0], "queue": "reports"}, _items(1, start=1)[0]]
    )
    single = jobs.request(KIND, ("test.single", 2), queue="reports")
    key_of = {m.task["args"][0]: m.key for m in OrmQ.objects.all()}
    assert key_of[reports.id] == key_of[single.id] == queue.list_key("reports")
    assert key_of[default.id] == Conf.CLUSTER_NAME != key_of[reports.id]


@pytest.mark.django_db(transaction=True)
def test_request_many__existing_jobs_are_returned_and_other_params_conflict():
    earlier = jobs.request(KIND, ("test.bulk", 1), params={"n": 1})
    handles = jobs.request_many(_items(3))
    assert [h.created for h in handles] == [True, False, True]
    assert handles[1].id == earlier.id
    assert OrmQ.objects.count() == 3  # earlier's own, and the two new ones

    with pytest.raises(JobConflict, match="keys differing: n"):
        jobs.request_many([*_items(2, start=10), {**_items(1)[0], "params": {"n": 99}}])
    assert not Job.objects.filter(subject_id__in=["10", "11"]).exists(), "nothing of the call"


@pytest.mark.django_db(transaction=True)
def test_request_many__one_identity_twice_in_a_call():
    same = _items(1) * 2
    first, second = jobs.request_many(same)
    assert first.id == second.id and (first.created, second.created) == (True, False)
    assert OrmQ.objects.count() == 1
    with pytest.raises(JobConflict, match="twice with different params"):
        jobs.request_many([*_items(1, start=5), {**_items(1, start=5)[0], "params": {"n": 0}}])
    assert not Job.objects.filter(subject_id="5").exists()


@pytest.mark.django_db(transaction=True)
def test_request_many__run_after_sends_no_message_and_the_kind_defaults_apply(monkeypatch):
    """On django-q2's ORM broker the dispatcher sends a run_after's message when it is due
    (the PostgreSQL broker holds one until then: the next test)."""
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "BROKER_CLASS", None)
    later = timezone.now() + timedelta(hours=1)
    items = [
        api.JobRequest(KIND, ("test.bulk", 1), run_after=later, tenant="t9", priority=7),
        {"kind": KIND, "subject": ("test.bulk", 2), "queue": "default"},
    ]
    delayed, now = jobs.request_many(items)
    assert _message_ids() == [now.id]
    delayed.refresh()
    assert (delayed.job.next_attempt_at, delayed.job.enqueued_for) == (later, None)
    assert (delayed.job.tenant_key, delayed.job.priority) == ("t9", 7)
    assert now.job.max_attempts == jobs.request(KIND, ("test.other", 1)).job.max_attempts
    with pytest.raises(ValueError, match="aware"):
        jobs.request_many([{**items[1], "run_after": later.replace(tzinfo=None)}])


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_request_many__run_after_on_the_postgres_broker_is_sent_ahead_in_one_statement(
    monkeypatch,
):
    """Each waiting job's message is written with the batch, its lock at the job's due
    time and its job marked sent for it, one statement per queue for all of them."""
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "BROKER_CLASS", "jobs.broker.PostgresBroker")
    later = timezone.now() + timedelta(hours=1)
    items = [api.JobRequest(KIND, ("test.bulk", n), run_after=later) for n in range(50)]
    items.append(api.JobRequest(KIND, ("test.bulk", 99)))
    with CaptureQueriesContext(connection) as asked:
        handles = jobs.request_many(items)
    assert sorted(_message_ids()) == sorted(h.id for h in handles)
    held = {m.task["args"][0]: m for m in OrmQ.objects.all()}
    for handle in handles[:50]:
        handle.refresh()
        assert handle.job.enqueued_for == handle.job.next_attempt_at == later
        assert held[handle.id].lock == later
        assert held[handle.id].task["kwargs"] == {"due": later.isoformat()}
    assert held[handles[50].id].lock <= timezone.now()
    sends = [q["sql"] for q in asked.captured_queries if "django_q_ormq" in q["sql"]]
    assert len(sends) == 2, sends  # the due-now message, and all 50 held ones


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
    assert _message_ids() == sorted(h.id for h in a), "one message per job"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_request_many__the_postgresql_broker_gets_one_insert_and_one_notify(monkeypatch):
    monkeypatch.setattr(Conf, "BROKER_CLASS", "jobs.broker.PostgresBroker")
    with CaptureQueriesContext(connection) as q:
        handles = jobs.request_many(_items(50))
    notifies = [x["sql"] for x in q.captured_queries if "pg_notify" in x["sql"]]
    assert len(notifies) == 1
    assert _message_ids() == sorted(h.id for h in handles)
