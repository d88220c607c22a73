"""A worker's follow-on on the PostgreSQL broker (``jobs.tasks.follow_on``, docs/broker.md).

Each test plays django-q2's worker in this process: a message is taken as the pusher
takes it (locked until now + ``retry``), ``pre_execute`` announces it, and the task
function runs. The follow-on then takes the queue's next messages itself; each is
deleted only in the statement after its outcome committed, and one whose delivery
failed stays locked for the redelivery after ``retry``. The real-process half (a
worker killed while it runs a followed job) is in ``tests/e2e/test_broker.py``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest
from django.db import OperationalError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django_q.conf import Conf
from django_q.models import Failure, OrmQ
from django_q.signals import pre_execute
from django_q.tasks import async_task

from jobs import registry, stats, tasks
from jobs.broker import PostgresBroker
from jobs.delivery import runner
from jobs.models import Attempt, Effect, Job, Notice
from tests.jobs.helpers import new_job

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

State = Job.State


@pytest.fixture
def pg_queue(monkeypatch):
    """The PostgreSQL broker, ``timeout`` 120 s and ``retry`` 180 s (the site's: the budget
    is not cut by a kind's timeout that another test registered)."""
    monkeypatch.setattr(Conf, "BROKER_CLASS", "jobs.broker.PostgresBroker")
    monkeypatch.setattr(Conf, "TIMEOUT", 120)
    monkeypatch.setattr(Conf, "RETRY", 180)
    monkeypatch.setattr(Conf, "SYNC", False)
    return PostgresBroker()


def _jobs(user, n: int, **params) -> list[Job]:
    with transaction.atomic():  # one commit, as a burst: n messages on the default list
        return [new_job(user, revision=r, **params) for r in range(1, n + 1)]


def _deliver_first(broker: PostgresBroker, **task) -> tuple[int, str]:
    """What django-q2's pusher and worker do for the oldest message: take it, announce it
    (``pre_execute``) and call the task; returns the message id and the task's result."""
    [(msg_id, _payload)] = broker._take()
    package = {"func": tasks.RUN_JOB, "ack_id": msg_id, **task}
    job_id = OrmQ.objects.get(pk=msg_id).args()[0]
    pre_execute.send(sender="django_q", func=tasks.run_job, task=package)
    return msg_id, tasks.run_job(job_id)


def _locked(msg_id: int) -> bool:
    with connection.cursor() as cur:
        cur.execute("SELECT lock > now() FROM django_q_ormq WHERE id = %s", [msg_id])
        return cur.fetchone()[0]


def test_follow_on__runs_the_queues_next_messages_each_acknowledged_after_its_outcome(
    pg_queue, django_user_model, caplog
):
    user = django_user_model.objects.create_user(username="follow")
    jobs = _jobs(user, 4)
    with CaptureQueriesContext(connection) as queries:
        _first, outcome = _deliver_first(pg_queue)
    assert outcome == Attempt.Outcome.SUCCEEDED
    assert Job.objects.filter(pk__in=[j.pk for j in jobs], state=State.SUCCEEDED).count() == 4
    assert Attempt.objects.filter(job__in=jobs).count() == 4, "one delivery each"
    assert Notice.objects.filter(effect__job__in=jobs).count() == 4
    assert not OrmQ.objects.exists(), "every message acknowledged, the first one too"
    [line] = [r.getMessage() for r in caplog.records if r.name == "jobs.tasks"]
    assert line.startswith("worker followed on to 3 message(s); the task took ")

    # Each message is deleted by the statement right after its job's publish (never before
    # it), which also takes the next one; the last finds none due.
    sql = [q["sql"] for q in queries.captured_queries]
    follows = [i for i, s in enumerate(sql) if "WITH acked AS (DELETE FROM django_q_ormq" in s]
    publishes = [i for i, s in enumerate(sql) if "jobs_artifact" in s and "INSERT" in s]
    assert len(follows) == len(publishes) == 4, (follows, publishes)
    assert all(p < f for p, f in zip(publishes, follows, strict=True))
    assert all(f < p for f, p in zip(follows, publishes[1:], strict=False))


def test_follow_on__sends_an_effect_whose_release_message_is_next(
    pg_queue, django_user_model, monkeypatch
):
    """An in-app notice that failed at the publish leaves with its own message
    (``release_effect``) on the same list: the worker that published takes it next."""
    user = django_user_model.objects.create_user(username="follow-effect")
    [job] = _jobs(user, 1)
    inapp, calls = registry.get_provider("inapp"), []
    real = inapp.notice_for

    def fails_once(effect):
        calls.append(effect.pk)
        if len(calls) == 1:
            raise ConnectionResetError("notice store unavailable")
        return real(effect)

    monkeypatch.setattr(inapp, "notice_for", fails_once)
    _deliver_first(pg_queue)
    effect = Effect.objects.get(job=job)
    assert len(calls) == 2, "applied by the followed release_effect message"
    assert effect.state == Effect.State.APPLIED
    assert Notice.objects.filter(effect=effect).count() == 1
    assert not OrmQ.objects.exists()


def test_follow_on__stays_on_the_list_its_first_message_came_from(pg_queue, django_user_model):
    """A worker of one queue (``jobs_worker --queue``) follows on that queue only: the list
    is the first message's own (django-q2's pusher overwrites the task's ``cluster``)."""
    import jobs

    user = django_user_model.objects.create_user(username="follow-queue")
    with transaction.atomic():
        routed = [
            jobs.request(
                "test.steps",
                ("auth.user", user.pk),
                revision=r,
                tenant="t1",
                params={"recipients": [user.pk]},
                queue="bulk",
            ).job
            for r in (1, 2)
        ]
        [default] = _jobs(user, 1, subject=user.pk + 1000)
    routed_key = OrmQ.objects.get(pk=OrmQ.objects.order_by("id")[0].pk).key
    assert routed_key != pg_queue.key
    [(msg_id, _payload)] = PostgresBroker(list_key=routed_key)._take()
    pre_execute.send(
        sender="django_q", func=tasks.run_job, task={"func": tasks.RUN_JOB, "ack_id": msg_id}
    )
    tasks.run_job(routed[0].pk)
    assert [Job.objects.get(pk=j.pk).state for j in routed] == [State.SUCCEEDED] * 2
    assert Job.objects.get(pk=default.pk).state == State.QUEUED
    [left] = OrmQ.objects.all()
    assert left.key == pg_queue.key and not _locked(left.pk)


def test_follow_on__a_failed_delivery_stays_locked_for_the_redelivery(
    pg_queue, django_user_model, monkeypatch
):
    """A delivery that failed before an outcome (here the database refusing the claim of
    the third job) is not acknowledged: its message is locked until ``retry`` runs out,
    and the follow-on stops there, leaving the rest to the pushers."""
    user = django_user_model.objects.create_user(username="follow-fail")
    jobs = _jobs(user, 4)
    real = runner.run_delivery

    def refused(job_id, **kwargs):
        if job_id == jobs[2].pk:
            raise OperationalError("the server refused the claim")
        return real(job_id, **kwargs)

    monkeypatch.setattr(runner, "run_delivery", refused)
    _deliver_first(pg_queue)
    states = dict(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("pk", "state"))
    assert [states[j.pk] for j in jobs] == [
        State.SUCCEEDED,
        State.SUCCEEDED,
        State.QUEUED,
        State.QUEUED,
    ]
    left = {m.args()[0]: m for m in OrmQ.objects.all()}
    assert set(left) == {jobs[2].pk, jobs[3].pk}
    assert _locked(left[jobs[2].pk].pk), "taken and unacknowledged: redelivered after retry"
    assert not _locked(left[jobs[3].pk].pk), "never taken: a pusher takes it"
    # Saved as django-q2's monitor saves a task that raised: jobs_stats counts it.
    [failure] = Failure.objects.all()
    assert failure.args == (jobs[2].pk,) and failure.attempt_count == 1
    assert "OperationalError" in failure.result and "refused" not in failure.result
    assert stats.failed_deliveries() == {"run_job": 1}


def test_follow_on__a_database_error_stops_it_and_the_delivery_keeps_its_outcome(
    pg_queue, django_user_model, monkeypatch, caplog
):
    """The first job's outcome is committed before the follow-on's first statement: a
    database that fails then costs the follow-on, never the delivery's result."""
    user = django_user_model.objects.create_user(username="follow-db")
    jobs = _jobs(user, 2)

    def gone(self, done, key):
        raise OperationalError("the server closed the connection")

    monkeypatch.setattr(PostgresBroker, "take_after", gone)
    first, outcome = _deliver_first(pg_queue)
    assert outcome == Attempt.Outcome.SUCCEEDED
    assert [Job.objects.get(pk=j.pk).state for j in jobs] == [State.SUCCEEDED, State.QUEUED]
    assert _locked(first), "the first message is left to django-q2's monitor"
    assert "follow-on stopped (OperationalError)" in caplog.text


def test_follow_on__hands_back_another_functions_message(pg_queue, django_user_model):
    """A message of another function goes back to the pushers as if never taken (django-q2
    runs it as usual), and the follow-on stops there: the job behind it is not taken."""
    user = django_user_model.objects.create_user(username="follow-other")
    [first] = _jobs(user, 1)
    async_task("math.floor", 1.5)
    [behind] = _jobs(user, 1, subject=user.pk + 1000)
    _deliver_first(pg_queue)
    assert Job.objects.get(pk=first.pk).state == State.SUCCEEDED
    assert Job.objects.get(pk=behind.pk).state == State.QUEUED
    other, behind_msg = OrmQ.objects.order_by("id")
    assert other.func() == "math.floor" and not _locked(other.pk)
    assert behind_msg.args() == (behind.pk,) and not _locked(behind_msg.pk)


def test_follow_on__hands_back_a_message_that_asks_for_django_q2s_own_handling(
    pg_queue, django_user_model
):
    """A run_job message with a hook (or a group, a cached result, a timeout of its own):
    only django-q2's worker and monitor do those, so a pusher must take it."""
    user = django_user_model.objects.create_user(username="follow-hook")
    [job] = _jobs(user, 1)
    OrmQ.objects.all().delete()
    async_task(tasks.RUN_JOB, job.pk, hook="math.floor")
    assert tasks.follow_on(None, list_key=pg_queue.key, started=time.monotonic()) == 0
    [message] = OrmQ.objects.all()
    assert not _locked(message.pk)
    assert Job.objects.get(pk=job.pk).state == State.QUEUED


def test_follow_on__a_message_it_cannot_read_goes_back_to_the_pusher(pg_queue):
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO django_q_ormq (key, payload, lock) VALUES (%s, %s, now()) RETURNING id",
            [pg_queue.key, "not a signed package " + uuid.uuid4().hex],
        )
        [msg_id] = cur.fetchone()
    assert tasks.follow_on(None, list_key=pg_queue.key, started=time.monotonic()) == 0
    assert OrmQ.objects.filter(pk=msg_id).exists() and not _locked(msg_id)


def test_follow_on__off_at_zero_seconds_leaves_the_queue_to_the_pushers(
    pg_queue, django_user_model, settings
):
    settings.JOBS_FOLLOW_ON_SECONDS = 0
    user = django_user_model.objects.create_user(username="follow-off")
    jobs = _jobs(user, 3)
    first, _ = _deliver_first(pg_queue)
    assert [Job.objects.get(pk=j.pk).state for j in jobs] == [
        State.SUCCEEDED,
        State.QUEUED,
        State.QUEUED,
    ]
    # The first message is django-q2's monitor's to acknowledge; the others were never taken.
    assert _locked(first)
    assert OrmQ.objects.count() == 3


def test_follow_on__stops_when_the_budget_is_spent(pg_queue, django_user_model, monkeypatch):
    user = django_user_model.objects.create_user(username="follow-budget")
    jobs = _jobs(user, 3)
    monkeypatch.setattr(runner, "follow_on_budget", lambda: 0.5)
    [(msg_id, _payload)] = pg_queue._take()
    tasks.run_job(OrmQ.objects.get(pk=msg_id).args()[0])  # no pre_execute: no follow-on
    assert tasks.follow_on(msg_id, started=time.monotonic() - 0.6) == 0
    assert [Job.objects.get(pk=j.pk).state for j in jobs][1:] == [State.QUEUED, State.QUEUED]
    assert OrmQ.objects.filter(pk=msg_id).exists(), "left to the monitor"


def test_follow_on__budget_leaves_the_longest_kind_its_timeout_and_grace(monkeypatch, settings):
    """Followed jobs run under django-q2's alarm for the first task: the budget ends early
    enough that a job taken at its end still has its kind's timeout and grace."""
    from jobs import registry

    monkeypatch.setattr(Conf, "TIMEOUT", 120)
    settings.JOBS_TIMEOUT_GRACE_SECONDS = 5
    settings.JOBS_FOLLOW_ON_SECONDS = 1.0
    kind = registry.get_kind("test.steps")

    def with_timeout(seconds):
        monkeypatch.setitem(registry._kinds, kind.name, dataclasses.replace(kind, timeout=seconds))
        return runner.follow_on_budget()

    assert with_timeout(10) == 1.0
    assert with_timeout(113.5) == 0.5  # 120 - 113.5 - 5 - 1 (runner.HARD_STOP_MARGIN)
    assert with_timeout(119) == 0.0
