"""jobs.broker.PostgresBroker on a real PostgreSQL: NOTIFY with the commit, SKIP LOCKED takes,
redelivery after ``retry``, no query while idle, and a listener that dies and comes back.

A second psycopg connection stands for the other sessions (a LISTENer of our own, a
cluster holding row locks, an operator terminating the listener's backend).
"""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django_q.conf import Conf
from django_q.models import OrmQ

from jobs.broker import PostgresBroker, channel_for
from jobs.testing.scratchdb import url_from_settings

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _url() -> str:
    return url_from_settings(connection.settings_dict)


@pytest.fixture
def conf(monkeypatch):
    """django-q2's Conf for these tests: retry 60 s, bulk 1, poll 0.05 s."""
    monkeypatch.setattr(Conf, "RETRY", 60)
    monkeypatch.setattr(Conf, "BULK", 1)
    monkeypatch.setattr(Conf, "POLL", 0.05)
    return Conf


@pytest.fixture
def broker(conf):
    b = PostgresBroker(list_key=f"test-{uuid.uuid4().hex[:8]}")
    yield b
    b.close()


@pytest.fixture
def other():
    """Another session on the test database (autocommit)."""
    with psycopg.connect(_url(), autocommit=True) as conn:
        yield conn


def _notes(conn: psycopg.Connection, timeout: float) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=timeout)]


def _listener_pid(b: PostgresBroker) -> int:
    return b._listener.info.backend_pid


def test_broker__enqueue_notifies_at_commit_and_not_on_rollback(broker, other):
    other.execute(f'LISTEN "{broker.channel}"')
    with transaction.atomic():
        broker.enqueue("one")
        broker.enqueue("two")
        assert _notes(other, 0.2) == [], "notified before the commit"
    assert _notes(other, 1.0) == [""], "one wake-up for the commit (NOTIFY folds duplicates)"

    with pytest.raises(RuntimeError), transaction.atomic():
        broker.enqueue("rolled back")
        raise RuntimeError("roll back")
    assert _notes(other, 0.5) == [], "a rolled-back enqueue woke a listener"
    assert sorted(OrmQ.objects.filter(key=broker.key).values_list("payload", flat=True)) == [
        "one",
        "two",
    ]
    assert broker.queue_size() == 2 and broker.lock_size() == 0


def test_broker__dequeue_takes_bulk_oldest_first_and_locks_until_retry(broker, conf):
    conf.BULK = 2
    ids = [broker.enqueue(f"m{i}") for i in range(3)]
    first = broker.dequeue()
    assert first == [(ids[0], "m0"), (ids[1], "m1")]
    assert broker.dequeue() == [(ids[2], "m2")]
    assert broker.queue_size() == 0 and broker.lock_size() == 3
    with connection.cursor() as cur:
        cur.execute(
            "SELECT min(EXTRACT(EPOCH FROM lock - now())), max(EXTRACT(EPOCH FROM lock - now())) "
            "FROM django_q_ormq WHERE key = %s",
            [broker.key],
        )
        lo, hi = cur.fetchone()
    assert 55 < lo <= hi <= 60, (lo, hi)
    broker.acknowledge(ids[0])
    broker.fail(ids[1])
    assert list(OrmQ.objects.filter(key=broker.key).values_list("id", flat=True)) == [ids[2]]
    assert broker.purge_queue() == 1 and broker.lock_size() == 0


def test_broker__skips_rows_another_session_holds(broker, other):
    held, free = broker.enqueue("held"), broker.enqueue("free")
    with other.transaction():
        other.execute("SELECT id FROM django_q_ormq WHERE id = %s FOR UPDATE", [held])
        started = time.monotonic()
        assert broker.dequeue() == [(free, "free")]
        assert time.monotonic() - started < 1.0, "the take waited on the other session's lock"
    assert broker.dequeue() == [(held, "held")]


def test_broker__redelivers_after_retry_waking_at_the_lock_expiry(broker, conf):
    """An unacknowledged message comes back after ``retry``: the idle pusher wakes at the
    lock's expiry (no NOTIFY happens then), well before its heartbeat."""
    conf.RETRY = 1.0
    pk = broker.enqueue("crashy")
    assert broker.dequeue() == [(pk, "crashy")]  # taken, never acknowledged
    taken = time.monotonic()
    got = None
    while got is None and time.monotonic() - taken < 4.0:  # heartbeat is 5 s
        got = broker.dequeue()
    waited = time.monotonic() - taken
    print(f"redelivered {waited * 1000:.0f} ms after the take (retry 1.0 s)")
    assert got == [(pk, "crashy")]
    assert 0.95 <= waited < 1.5, waited


def test_broker__a_delayed_message_is_taken_at_its_due_time(broker, settings):
    """Work due later: the NOTIFY makes the idle pusher look, and it wakes again at the
    due time (heartbeat 30 s here), not a poll or a heartbeat later."""
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "broker_heartbeat": 30.0}
    assert broker.dequeue() is None  # idle, next look in 30 s
    pk = broker.delayed(1.0).enqueue("later")
    enqueued = time.monotonic()
    assert broker.queue_size() == 0 and broker.lock_size() == 1
    got = None
    while got is None and time.monotonic() - enqueued < 3.0:
        got = broker.dequeue()
    waited = time.monotonic() - enqueued
    print(f"a message due in 1.0 s was taken after {waited * 1000:.0f} ms")
    assert got == [(pk, "later")]
    assert 0.95 <= waited < 1.3, waited


def test_broker__async_task_takes_the_delayed_broker(broker):
    from django_q.tasks import async_task

    async_task("jobs.tasks.run_job", 7, task_name="job-7", broker=broker.delayed(60))
    [message] = OrmQ.objects.filter(key=broker.key)
    assert (message.func(), tuple(message.args())) == ("jobs.tasks.run_job", (7,))
    with connection.cursor() as cur:
        cur.execute(
            "SELECT EXTRACT(EPOCH FROM lock - now()) FROM django_q_ormq WHERE id = %s", [message.pk]
        )
        assert 55 < cur.fetchone()[0] <= 60
    assert broker.dequeue() is None


def test_broker__an_idle_dequeue_sends_no_query_until_notified(broker, other):
    assert broker.dequeue() is None  # listens, looks once, waits a slice
    with CaptureQueriesContext(connection) as idle:
        for _ in range(3):
            assert broker.dequeue() is None
    assert len(idle) == 0, [q["sql"] for q in idle.captured_queries]

    pk = broker.enqueue("wake")  # autocommit: notifies at once
    started = time.monotonic()
    with CaptureQueriesContext(connection) as woken:
        got = broker.dequeue()
    elapsed = (time.monotonic() - started) * 1000
    print(f"woken and taken in {elapsed:.1f} ms, {len(woken)} query")
    assert got == [(pk, "wake")]
    assert len(woken) == 1
    assert elapsed < 100


def test_broker__a_notify_while_busy_is_not_lost(broker, other):
    """A message committed between a take and the wait is heard (LISTEN came first)."""
    assert broker.dequeue() is None
    pk = broker.enqueue("late")
    other.execute("SELECT pg_sleep(0.05)")
    assert broker.dequeue() == [(pk, "late")]


def test_broker__terminated_listener_polls_then_listens_again(broker, other, conf):
    assert broker.dequeue() is None
    pid = _listener_pid(broker)
    other.execute("SELECT pg_terminate_backend(%s)", [pid])
    time.sleep(0.1)
    # The next waits notice the dead listener; the pusher polls meanwhile.
    pk = broker.enqueue("during")
    got = None
    deadline = time.monotonic() + 2
    while got is None and time.monotonic() < deadline:
        got = broker.dequeue()
    assert got == [(pk, "during")]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and broker._listener is None:
        broker.dequeue()
    assert broker._listener is not None, "the broker did not listen again within 5 s"
    assert _listener_pid(broker) != pid
    pk = broker.enqueue("after")
    started = time.monotonic()
    got = None
    while got is None and time.monotonic() - started < 1:
        got = broker.dequeue()
    assert got == [(pk, "after")]
    assert time.monotonic() - started < 0.2


def test_broker__polls_when_listening_is_off(broker, settings):
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "broker_listen": False}
    assert broker.dequeue() is None
    assert broker._listener is None
    pk = broker.enqueue("polled")
    got = None
    deadline = time.monotonic() + 1
    while got is None and time.monotonic() < deadline:
        got = broker.dequeue()
    assert got == [(pk, "polled")]


def test_broker__dequeue_survives_a_lost_database_connection(broker, other):
    broker.dequeue()
    other.execute("SELECT pg_terminate_backend(%s)", [connection.connection.info.backend_pid])
    pk = None
    deadline = time.monotonic() + 5
    got = None
    while got is None and time.monotonic() < deadline:
        if pk is None:
            try:
                pk = broker.enqueue("after the cut")
            except Exception:  # the first use of the killed connection fails
                continue
        got = broker.dequeue()
    assert got == [(pk, "after the cut")]


def test_broker__long_queue_names_get_a_short_channel():
    name = channel_for("q" * 100)
    assert len(name) <= 63 and name.startswith("django_q_")
    assert channel_for("permits") == "django_q_permits"
