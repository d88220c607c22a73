"""No task can kill a worker: ``sys.exit(1)`` in a task fails that attempt, the process runs on."""

from __future__ import annotations

import pytest

from jobs.backends import TaskResultStatus
from jobs.models import Attempt
from tests.e2e.processes import wait_until
from tests.testapp import tasks

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _finished(result):
    def check():
        result.refresh()
        return result.is_finished

    return check


def test_task_exit__fails_its_first_attempt_and_the_same_worker_runs_the_next_task(procs):
    procs.start("qcluster", "qcluster")  # one worker process (tests/settings.py)

    before = tasks.worker_pid.enqueue()
    wait_until(procs, f"task result {before.id}", _finished(before), timeout=30)
    exited = tasks.exits.enqueue(1)
    wait_until(procs, f"task result {exited.id}", _finished(exited), timeout=30)
    after = tasks.worker_pid.enqueue()
    wait_until(procs, f"task result {after.id}", _finished(after), timeout=30)

    assert exited.status == TaskResultStatus.FAILED
    assert [e.exception_class for e in exited.errors] == [SystemExit]
    assert "sys.exit(code)" in exited.errors[0].traceback
    [claim] = Attempt.objects.filter(job_id=int(exited.id), number__gt=0)
    assert (claim.number, claim.outcome, claim.error_type) == (1, "failed", "builtins.SystemExit")

    assert after.status == TaskResultStatus.SUCCESSFUL
    # The one worker process ran the task before the exit and the one after it: the
    # exit ended neither the process nor the cluster (its claims are one identity).
    assert after.return_value == before.return_value
    [next_claim] = Attempt.objects.filter(job_id=int(after.id), number__gt=0)
    assert next_claim.worker == claim.worker
