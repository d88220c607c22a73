"""``@task`` functions through ``jobs.backends.JobsBackend`` on a real qcluster (PostgreSQL).

The cluster and the dispatcher loop are separate processes; the test only enqueues
and reads results, as a web process would.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.backends import TaskResultStatus
from jobs.models import Attempt, Job
from tests.e2e.processes import wait_until
from tests.testapp import tasks

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _finished(result):
    def check():
        result.refresh()
        return result.is_finished

    return check


def test_tasks_backend__enqueue_identity_run_after_and_errors_on_a_qcluster(procs):
    procs.start("qcluster", "qcluster")
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.5")

    summed = tasks.add.enqueue(20, 22)
    again = tasks.add.enqueue(20, 22, jobs_identity="answer")
    same = tasks.add.enqueue(20, 22, jobs_identity="answer")
    later_at = timezone.now() + timedelta(seconds=3)
    later = tasks.add.using(run_after=later_at).enqueue(1, 2)
    failed = tasks.explode.enqueue("e2e")

    for result in (summed, again, failed, later):
        wait_until(procs, f"task result {result.id}", _finished(result), timeout=60)

    assert summed.status == TaskResultStatus.SUCCESSFUL and summed.return_value == {"sum": 42}
    assert same.id == again.id
    same.refresh()
    assert same.return_value == {"sum": 42}
    assert Job.objects.filter(subject_id="answer").count() == 1

    assert later.status == TaskResultStatus.SUCCESSFUL and later.return_value == {"sum": 3}
    assert later.started_at >= later_at  # not before run_after (the database's clock)

    assert failed.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in failed.errors] == ["builtins.ValueError"]
    assert "exploded with code e2e" in failed.errors[0].traceback

    # Each ran as a job of the engine: one claim each, recorded with its outcome.
    for result, outcome in ((summed, "succeeded"), (later, "succeeded"), (failed, "dead")):
        claims = Attempt.objects.filter(job_id=int(result.id), number__gt=0)
        assert list(claims.values_list("outcome", flat=True)) == [outcome]
        assert result.worker_ids == [claims.get().worker]
