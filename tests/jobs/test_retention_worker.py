"""``JOBS_RETENTION_DAYS``: the worker's maintenance round prunes old history at most once an
hour (``jobs.retention.prune_when_due``), never inside the redelivery window (jobs.E041)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import dispatch, retention
from jobs.delivery.runner import run_delivery
from jobs.models import Attempt, Effect, Job
from tests.jobs.helpers import new_job

pytestmark = pytest.mark.django_db


@pytest.fixture
def fresh_round(monkeypatch):
    monkeypatch.setattr(retention, "_pruned_at", float("-inf"))


def _finished_long_ago(user, revision: int, days: float) -> Job:
    job = new_job(user, revision=revision)
    assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    then = timezone.now() - timedelta(days=days)
    Job.objects.filter(pk=job.pk).update(finished_at=then)
    Attempt.objects.filter(job=job).update(started_at=then)
    Effect.objects.filter(job=job).update(updated_at=then)
    return job


def test_retention__off_by_default_the_round_prunes_nothing(make_user, fresh_round):
    job = _finished_long_ago(make_user(), 1, days=400)
    assert dispatch.dispatch_once()["pruned"] == 0
    assert Attempt.objects.filter(job=job).exists()


def test_retention__the_round_prunes_old_attempts_once_an_hour_keeps_the_job(
    make_user, settings, fresh_round
):
    settings.JOBS_RETENTION_DAYS = 30
    user = make_user()
    old = _finished_long_ago(user, 1, days=40)
    recent = _finished_long_ago(user, 2, days=1)
    assert dispatch.dispatch_once()["pruned"] >= 1
    assert not Attempt.objects.filter(job=old).exists()
    assert Attempt.objects.filter(job=recent).exists()
    assert Job.objects.filter(pk=old.pk).exists(), "the identity stays: the same job again"
    again = _finished_long_ago(user, 3, days=40)
    assert dispatch.dispatch_once()["pruned"] == 0, "at most once an hour in a process"
    assert Attempt.objects.filter(job=again).exists()


def test_retention__a_window_inside_the_redelivery_window_fails_the_check(settings):
    settings.JOBS_RETENTION_DAYS = 0.5
    [error] = retention.check_retention_days()
    assert error.id == "jobs.E041" and "JOBS_RETENTION_DAYS" in error.msg
    settings.JOBS_RETENTION_DAYS = None
    assert retention.check_retention_days() == []
