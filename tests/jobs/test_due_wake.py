"""Work due later waits on its row: a retry's backoff and a ``run_after`` are due times on
the job, claimable by the next-job claim once they come and not before, with no message
at any time (the jobs table is the queue). The stall check and the console read the same
rows: a job waiting for its due time is no sign of a wedged cluster, and counts as
waiting, not as taken.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.utils import timezone
from django_q.models import OrmQ

import jobs
from jobs.models import Attempt, Job
from tests.jobs.helpers import claim_next, deliver, new_job

pytestmark = [pytest.mark.django_db(transaction=True)]


def _failed_once(users, username: str) -> Job:
    """A job of a new user whose first attempt failed for a while: it waits to be retried."""
    job = new_job(users.objects.create_user(username=username), fail={"1": "temporary"})
    assert deliver(job.pk).outcome == "retry"
    job.refresh_from_db()
    assert job.state == Job.State.RETRY_WAIT and job.next_attempt_at > timezone.now()
    return job


def _come_due(job: Job) -> None:
    """Time passes: the job's due time is a second past, by the server's clock."""
    Job.objects.filter(pk=job.pk).update(next_attempt_at=Now() - timedelta(seconds=1))


def test_retry__claimable_at_its_due_time_not_before_and_with_no_message(django_user_model):
    job = _failed_once(django_user_model, "due-wake")
    assert not OrmQ.objects.exists(), "no message for the retry, nor for the first run"
    assert claim_next() is None, "not due yet"
    _come_due(job)
    claim = claim_next()
    assert claim.won and claim.job.pk == job.pk and claim.job.attempts == 2
    assert claim_next() is None, "claimed once"


def test_run_after__the_job_waits_on_its_row_for_that_time(django_user_model):
    user = django_user_model.objects.create_user(username="due-later")
    later = timezone.now() + timedelta(minutes=5)
    handle = jobs.request("test.steps", ("auth.user", user.pk), params={}, run_after=later)
    handle.refresh()
    assert handle.job.next_attempt_at == later and handle.job.state == Job.State.QUEUED
    assert not OrmQ.objects.exists()
    assert claim_next() is None


def test_run_after_in_the_past__the_job_is_claimable_now(django_user_model):
    user = django_user_model.objects.create_user(username="due-past")
    handle = jobs.request(
        "test.steps", ("auth.user", user.pk), params={}, run_after=timezone.now() - timedelta(1)
    )
    claim = claim_next()
    assert claim.won and claim.job.pk == handle.id
    assert not OrmQ.objects.exists()


def test_supervisor__a_retry_waiting_for_its_due_time_is_no_sign_of_a_wedged_cluster(
    django_user_model,
):
    """A retry whose due time has not come is waiting, not stuck; one due for longer than
    the grace and never claimed is the sign (``supervisor.messages_waiting``)."""
    from jobs import supervisor

    job = _failed_once(django_user_model, "due-stall")
    Attempt.objects.filter(job=job).update(started_at=timezone.now() - timedelta(hours=1))
    Job.objects.filter(pk=job.pk).update(next_attempt_at=timezone.now() + timedelta(seconds=60))
    assert supervisor.messages_waiting(stall=30, grace=5) == ""
    # Due a minute ago and no claim took it: that is what a wedged cluster leaves.
    Job.objects.filter(pk=job.pk).update(next_attempt_at=timezone.now() - timedelta(seconds=60))
    assert "not claimed" in supervisor.messages_waiting(stall=30, grace=5)


def test_console__a_retry_waiting_for_its_due_time_is_counted_as_waiting_not_as_taken(
    django_user_model, settings
):
    from jobs.ops import console

    settings.JOBS_LEASE_SECONDS = 60  # claimed below, not run
    job = _failed_once(django_user_model, "due-console")
    assert console.queue_depth() == (1, 0, 1), "waiting for the job's due time"
    _come_due(job)
    assert console.queue_depth() == (1, 0, 0), "due now, not yet taken"
    assert claim_next().won
    assert console.queue_depth() == (1, 1, 0), "a cluster took it"
