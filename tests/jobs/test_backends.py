"""``jobs.backends.JobsBackend``: ``@task`` functions as jobs, in this process (see also e2e)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django_q.models import OrmQ

import jobs
from jobs import backends, registry
from jobs.delivery.runner import run_delivery
from jobs.models import Job
from tests.testapp import tasks

pytestmark = pytest.mark.django_db
Status = backends.TaskResultStatus


def test_backend__registers_its_kind_only_where_configured(settings):
    assert registry.get_kind(backends.KIND).handler is backends.run_task
    assert backends.configured_aliases() == ["default", "once"]
    settings.TASKS = {"default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}}
    assert backends.configured_aliases() == []


def test_enqueue__one_job_row_no_message_and_a_result_that_follows_it():
    result = tasks.add.enqueue(2, 3)
    job = Job.objects.get(pk=int(result.id))
    assert (job.kind, job.subject_type) == (backends.KIND, "tests.testapp.tasks.add")
    assert job.params["args"] == [2, 3] and job.params["kwargs"] == {}
    assert job.state == Job.State.QUEUED and job.next_attempt_at <= timezone.now(), "due now"
    assert OrmQ.objects.count() == 0, "the jobs table is the queue: no django_q_ormq row"
    assert (result.status, result.is_finished, result.args) == (Status.READY, False, [2, 3])

    run_delivery(job.pk, worker="w1")
    result.refresh()

    assert result.status == Status.SUCCESSFUL
    assert result.return_value == {"sum": 5}
    assert result.worker_ids == ["w1"] and result.attempts == 1
    assert result.errors == []
    assert tasks.add.get_result(result.id).return_value == {"sum": 5}
    assert job.artifacts.get().content_type == "application/json"


def test_enqueue__the_same_identity_is_one_job_and_other_args_are_refused():
    first = tasks.add.enqueue(1, 1, jobs_identity="sum-1-1")
    again = tasks.add.enqueue(1, 1, jobs_identity="sum-1-1")
    assert first.id == again.id
    assert again.kwargs == {}  # the identity is the backend's, not the function's
    assert Job.objects.count() == 1 and OrmQ.objects.count() == 0
    with pytest.raises(jobs.JobConflict):
        tasks.add.enqueue(1, 2, jobs_identity="sum-1-1")
    assert tasks.add.enqueue(1, 1).id != first.id  # no identity: a new job each time


def test_enqueue__run_after_waits_on_its_row_until_that_time():
    later = timezone.now() + timedelta(minutes=10)
    result = tasks.add.using(run_after=later).enqueue(4, 4)
    job = Job.objects.get(pk=int(result.id))
    assert job.next_attempt_at == later and OrmQ.objects.count() == 0
    assert run_delivery(job.pk, worker="early").outcome == "duplicate"
    assert tasks.add.get_result(result.id).status == Status.READY


def test_task_error__real_class_and_formatted_traceback_without_arguments():
    result = tasks.explode.enqueue("c-17")
    run_delivery(int(result.id), worker="w1")
    result.refresh()

    assert result.status == Status.FAILED  # MAX_ATTEMPTS 1 on the "once" backend
    [error] = result.errors
    assert error.exception_class_path == "builtins.ValueError"
    assert error.exception_class is ValueError
    assert error.traceback.startswith("Traceback (most recent call last):")
    assert 'tasks.py", line' in error.traceback and "in explode" in error.traceback
    assert error.traceback.endswith("ValueError: exploded with code c-17\n")
    job = Job.objects.get(pk=int(result.id))
    assert (job.state, job.last_error_class, job.last_error_code) == (
        "dead",
        "unknown",
        "builtins.ValueError",
    )
    assert job.last_error_message == "exploded with code c-17"
    assert "c-17" not in job.last_error_detail  # the short detail names the class only
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018


@tasks.task(takes_context=True)
def fails_twice(context) -> int:
    """Found by its path (tests.jobs.test_backends.fails_twice) in the worker, as any task."""
    if context.attempt < 3:
        raise KeyError(f"pool-{context.attempt}")
    return context.attempt


def test_task_errors__one_per_failed_attempt_also_after_a_later_success():
    """Django's contract: ``errors`` holds one TaskError per failed attempt, whatever came after."""
    result = fails_twice.enqueue()
    for attempt in (1, 2, 3):
        Job.objects.filter(pk=int(result.id)).update(
            next_attempt_at=timezone.now() - timedelta(seconds=1)
        )
        run_delivery(int(result.id), worker=f"w{attempt}")
    result.refresh()

    assert (result.status, result.return_value, result.attempts) == (Status.SUCCESSFUL, 3, 3)
    assert [e.exception_class for e in result.errors] == [KeyError, KeyError]
    assert [e.traceback.splitlines()[-1] for e in result.errors] == [
        "KeyError: 'pool-1'",
        "KeyError: 'pool-2'",
    ]
    again = fails_twice.get_backend().get_result(result.id)
    assert [e.exception_class_path for e in again.errors] == ["builtins.KeyError"] * 2


def test_task__takes_context_sees_its_attempt_and_a_bad_return_value_fails_once():
    ok = tasks.which_attempt.enqueue()
    run_delivery(int(ok.id), worker="w1")
    ok.refresh()
    assert ok.return_value == 1

    bad = tasks.not_json.enqueue()
    run_delivery(int(bad.id), worker="w1")
    bad.refresh()
    job = Job.objects.get(pk=int(bad.id))
    assert (bad.status, job.state, job.last_error_class) == (Status.FAILED, "failed", "validation")
    assert "not JSON-serialisable" in job.last_error_detail


def test_get_result__unknown_ids_do_not_exist():
    backend = tasks.add.get_backend()
    for missing in ("999999", "not-a-number"):
        with pytest.raises(backends.TaskResultDoesNotExist):
            backend.get_result(missing)


def test_contract__signals_started_and_finished_with_the_backend_class_as_sender():
    from jobs.tasks import run_job

    seen = []

    def record(signal_name):
        def receiver(sender, task_result, **kwargs):
            seen.append((signal_name, sender, task_result.status))

        return receiver

    started, finished = record("started"), record("finished")
    backends.task_started.connect(started)
    backends.task_finished.connect(finished)
    try:
        ok = tasks.add.enqueue(1, 2)
        run_job(int(ok.id))
        bad = tasks.explode.enqueue("s-1")
        run_job(int(bad.id))
    finally:
        backends.task_started.disconnect(started)
        backends.task_finished.disconnect(finished)
    assert seen == [
        ("started", backends.JobsBackend, Status.RUNNING),
        ("finished", backends.JobsBackend, Status.SUCCESSFUL),
        ("started", backends.JobsBackend, Status.RUNNING),
        ("finished", backends.JobsBackend, Status.FAILED),
    ]


def test_contract__non_json_arguments_and_return_values_are_type_errors():
    with pytest.raises(TypeError, match="Unsupported type") as raised:
        tasks.add.enqueue(timezone.now(), 1)
    assert isinstance(raised.value, jobs.PayloadInvalid)  # the engine's validation error too
    assert Job.objects.count() == 0

    bad = tasks.not_json.enqueue()
    run_delivery(int(bad.id), worker="w1")
    bad.refresh()
    assert bad.status == Status.FAILED and bad.attempts == 1  # no retry: the same every time
    assert bad.errors[0].exception_class is TypeError
    assert "Unsupported type" in bad.errors[0].traceback


def test_contract__get_result_returns_the_task_as_enqueued():
    later = timezone.now() + timedelta(minutes=5)
    enqueued = tasks.add.using(run_after=later, backend="once").enqueue(1, 2)
    again = tasks.add.get_backend().get_result(enqueued.id)
    assert again.task == enqueued.task
    assert (again.task.run_after, again.task.backend) == (later, "once")
    assert again == enqueued


def test_contract__async_tasks_run_in_the_worker():
    assert backends.JobsBackend.supports_async_task is True
    result = tasks.add_async.enqueue(20, 22)
    run_delivery(int(result.id), worker="w1")
    result.refresh()
    assert (result.status, result.return_value) == (Status.SUCCESSFUL, {"sum": 42})


@pytest.fixture
def any_queue(settings):
    """The default alias with ``QUEUES: []``: Django accepts every queue name."""
    settings.TASKS = {**settings.TASKS, "default": {"BACKEND": backends.BACKEND, "QUEUES": []}}


def test_enqueue__priority_and_queue_name_are_the_jobs(any_queue):
    """``supports_priority``: a task's priority and queue reach ``jobs.request``; the
    claim orders by the one and routes by the other (docs/app/scheduling.md)."""
    assert backends.JobsBackend.supports_priority is True
    result = tasks.add.using(priority=7, queue_name="reports").enqueue(1, 2)
    job = Job.objects.get(pk=int(result.id))
    assert (job.priority, job.queue) == (7, "reports")
    assert result.task.priority == 7 and result.task.queue_name == "reports"
    plain = Job.objects.get(pk=int(tasks.add.enqueue(3, 4).id))
    assert (plain.priority, plain.queue) == (0, "default")
    with pytest.raises(backends.InvalidTask, match="priority must be a whole number"):
        tasks.add.using(priority=101)
    with pytest.raises(backends.InvalidTask, match="Queue 'reports' is not valid"):
        tasks.add.using(queue_name="reports", backend="once")  # Django's QUEUES: kept


def test_enqueue__a_queue_name_a_broker_list_cannot_carry_is_refused(any_queue):
    with pytest.raises(backends.InvalidTask, match="queue_name 'no spaces'"):
        tasks.add.using(queue_name="no spaces").enqueue(1, 1)
    assert Job.objects.count() == 0
