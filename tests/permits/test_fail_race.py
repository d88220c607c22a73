"""An operator's "Fail it" racing a worker's claim, on PostgreSQL with two connections.

The arrow is a compare-and-swap on the version the operator's page read: a fail that
holds the row first leaves the worker nothing to claim (its claim waits for the row and
then finds the job failed), and a claim that came first makes the operator's fail change
nothing. Never both: one history row or one more attempt, not the two.
"""

from __future__ import annotations

import threading

import pytest
from django.db import transaction

import jobs
from jobs import services as job_services
from jobs.delivery.runner import run_delivery
from jobs.engine import job_machine
from jobs.models import Attempt, Job, JobEvent
from permits import reports
from tests.permits.test_decisions import WAIT, blocked_on_a_lock, in_thread

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
REASON = "Names no request: nothing can build it."


@pytest.fixture
def waiting_malformed() -> Job:
    """A malformed report waiting to run again (a script requeued it)."""
    job = jobs.request(reports.KIND, (reports.SUBJECT_TYPE, "not-a-permit")).job
    assert run_delivery(job.pk, worker="w-1").outcome == "failed"
    job.refresh_from_db()
    assert job_services.requeue_job(job, operator="script")
    job.refresh_from_db()
    assert (job.state, job.last_error_code) == ("queued", "payload_invalid")
    return job


def test_fail_it__holding_the_row_first_leaves_the_worker_nothing_to_run(waiting_malformed):
    job = waiting_malformed
    failed, release = threading.Event(), threading.Event()

    def fail_and_hold():
        with transaction.atomic():
            won = job_machine.fail_by_operator(job, actor="operator:a", reason=REASON)
            failed.set()
            release.wait(WAIT)  # the row stays locked until the test lets go
        return won

    holder, held = in_thread(fail_and_hold)
    assert failed.wait(WAIT)
    worker, ran = in_thread(lambda: run_delivery(job.pk, worker="w-2"))
    # The worker's claim of this job waits for the row (or, on the next-job path, skips
    # it); either way it decides only after the operator's transaction ended.
    blocked_on_a_lock(worker)
    release.set()
    holder.join(WAIT)
    worker.join(WAIT)
    assert held.get("result") is True, held
    assert "error" not in ran, ran
    assert ran["result"].job_id != job.pk or ran["result"].outcome == "duplicate", ran
    job.refresh_from_db()
    assert (job.state, job.attempts) == ("failed", 1)
    # The worker's delivery found it ended: recorded as a duplicate delivery, nothing run.
    ran_attempts = Attempt.objects.filter(job=job, number__gt=0)
    assert list(ran_attempts.values_list("number", "outcome")) == [(1, "failed")]
    assert set(Attempt.objects.filter(job=job, number=0).values_list("outcome", flat=True)) <= {
        "duplicate_delivery"
    }
    assert JobEvent.objects.get(job=job, action="fail").note == REASON
    # Later deliveries find it failed: never run again.
    later = run_delivery(job.pk, worker="w-3")
    assert later.job_id != job.pk or later.outcome == "duplicate", later
    job.refresh_from_db()
    assert (job.state, job.attempts) == ("failed", 1)


def test_fail_it__after_a_worker_claimed_it_changes_nothing(waiting_malformed):
    job = waiting_malformed
    page_copy = Job.objects.get(pk=job.pk)  # what the operator's page read: queued
    claimed, release = threading.Event(), threading.Event()

    def hold_after_claim(stage: str, ctx) -> None:
        if stage == "claimed":
            claimed.set()
            release.wait(WAIT)

    worker, ran = in_thread(lambda: run_delivery(job.pk, worker="w-2", on_stage=hold_after_claim))
    assert claimed.wait(WAIT)
    assert not job_machine.fail_by_operator(page_copy, actor="operator:a", reason=REASON)
    running = Job.objects.get(pk=job.pk)
    assert running.state == "running"
    assert not job_machine.fail_by_operator(running, actor="operator:a", reason=REASON)
    release.set()
    worker.join(WAIT)
    assert ran["result"].outcome == "failed", ran  # the worker's own run decided
    job.refresh_from_db()
    assert (job.state, job.attempts) == ("failed", 2)
    assert not JobEvent.objects.filter(job=job, action="fail").exists()
