"""Restoring a finished job's artifact whose stored bytes no longer match its row.

Whoever finds the file missing or corrupt (a download, an operator) asks for a
restore (``jobs.queue.enqueue_restore``); a worker then re-runs the job kind's
producer under the job's stable key and rewrites the file in place — the same
artifact row, the same key, the same ``artifacts.verify`` a second worker uses when
it finds a bad file. The job's state and its effects are not touched: the notices
went out when the job published, and whatever effects the producer asks for again
are ignored."""

from __future__ import annotations

import logging

from django.db import transaction

from jobs import artifacts, registry, transitions
from jobs.exceptions import LeaseLost
from jobs.models import Artifact, Job
from jobs.retry import classify
from jobs.runner import JobContext

log = logging.getLogger("jobs.restore")


class RestoreContext(JobContext):
    """A handler context for a finished job: no lease; the job must still be succeeded."""

    def __init__(self, job: Job, worker: str, artifact: Artifact):
        super().__init__(job, worker, attempt=None, on_stage=None)
        self.target = artifact
        self.restored = False

    def check_owner(self) -> None:
        # Nobody holds a finished job; the fence is that it is still the finished job.
        if not Job.objects.filter(pk=self.job.pk, state=Job.State.SUCCEEDED).exists():
            raise LeaseLost(f"job {self.job.pk} is no longer succeeded")

    def heartbeat(self) -> None:
        """No lease to extend."""

    def store_artifact(self, data: bytes, *, content_type: str, extension: str) -> Artifact:
        self.check_owner()
        # The row lock makes concurrent restores of one artifact take turns: the second
        # finds the file intact and writes nothing.
        with transaction.atomic():
            locked = Artifact.objects.select_for_update().get(pk=self.target.pk)
            self.restored = artifacts.verify(locked, data=data)
        self.artifact = locked
        return locked


def restore_artifact(artifact_pk: int) -> str:
    """The django-q2 task: re-run the producer if the stored bytes are missing or corrupt.

    Never raises (a failed restore is not redelivered forever): the outcome is returned
    and logged with ids and error class only; the next reader who finds the file bad
    asks again.
    """
    artifact = Artifact.objects.select_related("job").filter(pk=artifact_pk).first()
    if artifact is None:
        return "missing"
    if artifacts.is_intact(artifact):
        return "intact"
    job = artifact.job
    if job.state != Job.State.SUCCEEDED:
        return "not_finished"  # the job's own worker stores and verifies it
    ctx = RestoreContext(job, transitions.worker_identity(), artifact)
    try:
        registry.get_kind(job.kind).handler(ctx)
    except Exception as exc:
        c = classify(exc)
        log.warning(
            "artifact=%s job=%s restore failed class=%s code=%s",
            artifact.pk,
            job.pk,
            c.error_class.value,
            c.code,
        )
        return f"failed:{c.error_class.value}"
    if ctx.artifact is None:
        return "not_produced"
    if not ctx.restored:
        return "intact"
    log.info("artifact=%s job=%s restored by re-running its producer", artifact.pk, job.pk)
    return "restored"
