"""Queue messages for jobs, effects and artifact restores: ids only, nothing private in the queue.

Call these inside the transaction that makes the row due: with django-q2's ORM
broker on the same database, the row and its message commit together or not at all.
"""

from __future__ import annotations

from django_q.tasks import async_task

from jobs.models import Artifact, Effect, Job


def enqueue_job(job: Job) -> None:
    """Put one message for ``job`` on the queue."""
    async_task("jobs.tasks.run_job", job.pk, task_name=f"job-{job.pk}")


def enqueue_effect(effect: Effect) -> None:
    """Put one message for sending ``effect`` on the queue."""
    async_task("jobs.tasks.release_effect", effect.pk, task_name=f"effect-{effect.pk}")


def enqueue_restore(artifact: Artifact) -> None:
    """Ask a worker to restore ``artifact`` if its stored bytes are missing or corrupt."""
    async_task(
        "jobs.restore.restore_artifact", artifact.pk, task_name=f"restore-artifact-{artifact.pk}"
    )
