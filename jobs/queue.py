"""Queue messages for jobs, effects and artifact restores: ids only, nothing private in the queue.

Call these inside the transaction that makes the row due: with django-q2's ORM
broker on the same database, the row and its message commit together or not at all.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Q
from django_q.tasks import async_task

from jobs import clock, conf
from jobs.models import Artifact, Effect, Job


def enqueue_job(job: Job) -> None:
    """Put one message for ``job`` on the queue."""
    async_task("jobs.tasks.run_job", job.pk, task_name=f"job-{job.pk}")


def enqueue_effect(effect: Effect) -> None:
    """Put one message for sending ``effect`` on the queue."""
    async_task("jobs.tasks.release_effect", effect.pk, task_name=f"effect-{effect.pk}")


def enqueue_restore(artifact: Artifact) -> bool:
    """Ask a worker to restore ``artifact``, unless a restore of it is already in flight.

    One conditional UPDATE takes the artifact's restore marker (free, or older than
    ``conf.restore_stale_seconds()`` by the server's clock) and the message commits
    with it, so however many readers find a bad file, one restore is queued. False
    when another request holds the marker, or the artifact is lost.
    """
    with transaction.atomic():
        taken = (
            Artifact.objects.filter(pk=artifact.pk, state=Artifact.State.STORED)
            .filter(
                Q(restore_requested_at__isnull=True)
                | Q(restore_requested_at__lt=clock.before(conf.restore_stale_seconds()))
            )
            .update(restore_requested_at=clock.Now())
        )
        if taken:
            async_task(
                "jobs.restore.restore_artifact",
                artifact.pk,
                task_name=f"restore-artifact-{artifact.pk}",
            )
    return bool(taken)
