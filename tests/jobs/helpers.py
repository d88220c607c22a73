"""Small helpers shared by the engine tests."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from jobs.models import Job
from jobs.services import request_job


def new_job(
    user=None, *, kind="test.steps", revision=1, tenant="t1", subject=None, **params
) -> Job:
    if user is not None:
        params.setdefault("recipients", [user.pk])
    job, _ = request_job(
        kind,
        subject_type="auth.user",
        subject_id=subject if subject is not None else (user.pk if user else 1),
        output_revision=revision,
        tenant_key=tenant,
        params=params,
    )
    return job


def make_due(job: Job) -> None:
    """Skip the backoff wait (the delay itself is asserted separately)."""
    Job.objects.filter(pk=job.pk).update(next_attempt_at=timezone.now() - timedelta(seconds=1))


def expire_lease(job: Job) -> None:
    Job.objects.filter(pk=job.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


class Crash(BaseException):
    """Stands in for a process dying: the runner does not catch BaseException."""
