"""Work due later is woken at its due time: a retry's and a ``run_after``'s message is sent
in the transaction that makes the job wait, held by the PostgreSQL broker until then
(``jobs.bulk.enqueue_job_when_due``), and the dispatcher sends no second one.

On django-q2's ORM broker (which compares a message's lock with the worker's clock) the
dispatcher still sends it when the job is due.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone
from django_q.conf import Conf
from django_q.models import OrmQ

import jobs
from jobs import dispatch
from jobs.broker import PostgresBroker
from jobs.models import Attempt, Job
from jobs.queue import POSTGRES_BROKER
from tests.jobs.helpers import deliver, new_job

pytestmark = [pytest.mark.django_db(transaction=True)]


def _messages(job: Job) -> list[OrmQ]:
    return [m for m in OrmQ.objects.all() if tuple(m.args()) == (job.pk,)]


@pytest.fixture
def pg_broker(monkeypatch):
    monkeypatch.setattr(Conf, "BROKER_CLASS", POSTGRES_BROKER)
    monkeypatch.setattr(Conf, "RETRY", 60)


@pytest.fixture
def orm_broker(monkeypatch):
    monkeypatch.setattr(Conf, "BROKER_CLASS", None)


def _failed_once(users, username: str) -> Job:
    """A job of a new user whose first attempt failed for a while: it waits to be retried."""
    job = new_job(users.objects.create_user(username=username), fail={"1": "temporary"})
    OrmQ.objects.all().delete()  # the first delivery's message, taken by this test
    assert deliver(job.pk).outcome == "retry"
    job.refresh_from_db()
    assert job.state == Job.State.RETRY_WAIT
    return job


@pytest.mark.postgres
def test_retry__its_message_is_sent_with_the_retry_and_held_until_its_due_time(
    pg_broker, django_user_model
):
    job = _failed_once(django_user_model, "due-wake")
    [message] = _messages(job)
    # Message and row agree on the due time to the microsecond; the message is marked sent.
    assert message.lock == job.next_attempt_at == job.enqueued_for
    broker = PostgresBroker()
    assert broker.queue_size() == 0, "not due yet: no pusher takes it"

    left = (job.next_attempt_at - timezone.now()).total_seconds()
    time.sleep(max(0.0, left) + 0.3)
    assert dispatch.dispatch_once()["due_jobs"] == 0, "its due time has its message already"
    [(pk, _payload)] = broker.dequeue() or [(None, None)]
    assert pk == message.pk
    broker.acknowledge(pk)
    assert deliver(job.pk).outcome == "succeeded"
    broker.close()


@pytest.mark.postgres
def test_run_after__its_message_waits_in_the_broker_for_that_time(pg_broker, django_user_model):
    user = django_user_model.objects.create_user(username="due-later")
    later = timezone.now() + timedelta(minutes=5)
    handle = jobs.request("test.steps", ("auth.user", user.pk), params={}, run_after=later)
    job = handle.job
    [message] = _messages(job)
    job.refresh_from_db()
    assert message.lock == job.next_attempt_at == job.enqueued_for == later
    assert dispatch.dispatch_once()["due_jobs"] == 0


@pytest.mark.postgres
def test_run_after_in_the_past__its_message_is_due_now(pg_broker, django_user_model):
    user = django_user_model.objects.create_user(username="due-past")
    handle = jobs.request(
        "test.steps", ("auth.user", user.pk), params={}, run_after=timezone.now() - timedelta(1)
    )
    [message] = _messages(handle.job)
    assert PostgresBroker().queue_size() == 1, "a due time already past: taken at once"
    assert message.lock <= timezone.now()


def test_orm_broker__the_dispatcher_sends_a_retry_when_it_is_due(orm_broker, django_user_model):
    job = _failed_once(django_user_model, "due-orm")
    assert _messages(job) == [], "no message before the dispatcher's"
    assert job.enqueued_for < job.next_attempt_at, "the last message was for an earlier due time"
    left = (job.next_attempt_at - timezone.now()).total_seconds()
    time.sleep(max(0.0, left) + 0.3)
    assert dispatch.dispatch_once()["due_jobs"] == 1
    assert len(_messages(job)) == 1


@pytest.mark.postgres
def test_supervisor__a_message_sent_ahead_is_no_sign_of_a_wedged_cluster(
    pg_broker, django_user_model, monkeypatch
):
    """A retry's message waits in the broker with its lock at the due time, which the
    stall check's window for taken messages covers. It is told apart by the due time it
    carries: untaken, it is no sign (even after an operator moved the job's due time, so
    that the job and the message no longer agree); taken and never begun, it is."""
    from jobs import supervisor

    monkeypatch.setattr(Conf, "RETRY", 180)
    job = _failed_once(django_user_model, "due-stall")
    Attempt.objects.filter(job=job).update(started_at=timezone.now() - timedelta(hours=1))
    [message] = _messages(job)
    later = timezone.now() + timedelta(seconds=60)
    OrmQ.objects.filter(pk=message.pk).update(lock=later)
    Job.objects.filter(pk=job.pk).update(next_attempt_at=later, enqueued_for=later)
    # The message says it was sent for ``later``: rewrite its payload as the engine would.
    from django_q.signing import SignedPackage

    task = message.task
    task["kwargs"]["due"] = later.isoformat()
    OrmQ.objects.filter(pk=message.pk).update(payload=SignedPackage.dumps(task))
    assert supervisor.messages_waiting(stall=30, grace=5) == ""
    # The operator ran it now: the job moved on, the message still waits for ``later``.
    Job.objects.filter(pk=job.pk).update(next_attempt_at=timezone.now())
    assert supervisor.messages_waiting(stall=30, grace=5) == ""
    # Taken a minute ago (its lock is then taken + retry) and no attempt began since.
    OrmQ.objects.filter(pk=message.pk).update(lock=timezone.now() + timedelta(seconds=120))
    assert "never begun" in supervisor.messages_waiting(stall=30, grace=5)


@pytest.mark.postgres
def test_console__a_message_sent_ahead_is_counted_as_waiting_not_as_taken(
    pg_broker, django_user_model
):
    from jobs.ops import console

    job = _failed_once(django_user_model, "due-console")
    [message] = _messages(job)
    assert console.queue_depth() == (1, 0, 1), "held for the job's due time"
    OrmQ.objects.filter(pk=message.pk).update(lock=timezone.now() + timedelta(seconds=170))
    assert console.queue_depth() == (1, 1, 0), "a cluster took it"
