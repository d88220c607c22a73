"""Restoring a published artifact whose stored file no longer matches its row.

A restore never changes published bytes. It may only put back bytes whose sha256
equals the row's:

1. from the replica storage (``JOBS_ARTIFACT_REPLICA_STORAGE``) if one is configured
   and its copy verifies;
2. else by re-running the job kind's producer (``RestoreContext``: nothing is stored
   or published by the handler; its bytes are captured) and accepting them only if
   their sha256 equals the row's.

When the producer runs and gives other bytes (the source data changed since the
publish), or refuses for good (validation, authorization), the artifact is marked
``lost`` with a reason the operator can read; readers get "rebuild it as a new
revision" and nothing is served. A transient failure of the producer (database or
dependency unavailable, an unknown error) marks nothing: the next reader who finds
the file bad asks again. The row's sha256, key and storage name never change.

At most one restore per artifact is in flight: ``jobs.queue.enqueue_restore`` takes
the row's ``restore_requested_at`` marker; the task clears it when it ends.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.db.models import Exists, F
from django.utils import timezone

from jobs import artifacts, registry
from jobs.delivery.runner import JobContext
from jobs.engine.job_machine import worker_identity
from jobs.exceptions import ArtifactCorrupt, LeaseLost, TemporaryFailure
from jobs.models import Artifact, Job
from jobs.retry import POLICY, classify

log = logging.getLogger("jobs.restore")


class RestoreContext(JobContext):
    """A handler context for a finished job: no lease, nothing stored; the bytes are captured."""

    def __init__(self, job: Job, worker: str, artifact: Artifact):
        super().__init__(job, worker, attempt=None, on_stage=None)
        self.target = artifact
        self.produced: bytes | None = None

    def _finished(self):
        # Nobody holds a finished job; the fence is that it is still the finished job.
        return Job.objects.filter(pk=self.job.pk, state=Job.State.SUCCEEDED)

    def _held(self):
        return Exists(self._finished())

    def check_owner(self) -> None:
        if not self._finished().exists():
            raise LeaseLost(f"job {self.job.pk} is no longer succeeded")

    def heartbeat(self) -> None:
        """No lease to extend."""

    def store_artifact(self, data: bytes, *, content_type: str, extension: str) -> Artifact:
        self.check_owner()
        self.produced = data
        self.artifact = self.target
        return self.target


def restore_artifact(artifact_pk: int) -> str:
    """The django-q2 task: put the published bytes back, or mark the artifact lost.

    Never raises (a failed restore is not redelivered forever): the outcome is returned
    and logged with ids and error class only. The restore marker is cleared at the end,
    whatever the outcome.
    """
    try:
        return _restore(artifact_pk)
    except TemporaryFailure as exc:  # the storage could not be read now: no verdict
        log.warning("artifact=%s restore postponed (%s)", artifact_pk, exc)
        return "failed:temporary"  # not lost; the next download asks again
    finally:
        Artifact.objects.filter(pk=artifact_pk).update(restore_requested_at=None)


def _restore(artifact_pk: int) -> str:
    artifact = Artifact.objects.select_related("job").filter(pk=artifact_pk).first()
    if artifact is None:
        return "missing"
    if artifact.state == Artifact.State.LOST:
        return "lost"
    if artifacts.is_intact(artifact):
        return "intact"
    job = artifact.job
    if job.state != Job.State.SUCCEEDED:
        return "not_finished"  # the job's own worker stores it

    replica = artifacts.get_replica_storage()
    if replica is not None:
        try:
            data = artifacts.read_verified(artifact, storage=replica)
        except ArtifactCorrupt:
            log.warning("artifact=%s job=%s replica copy missing or corrupt", artifact.pk, job.pk)
        else:
            return _put_back(artifact, data, "restored_from_replica")

    ctx = RestoreContext(job, worker_identity(), artifact)
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
        if POLICY[c.error_class].safe_to_retry:
            return f"failed:{c.error_class.value}"  # transient: not lost, ask again later
        return _mark_lost(
            artifact,
            f"re-running the producer was refused ({c.error_class.value}/{c.code[:64]})",
        )
    if ctx.produced is None:
        return _mark_lost(artifact, "re-running the producer stored no artifact")
    digest = artifacts.sha256_hex(ctx.produced)
    if digest != artifact.sha256:
        return _mark_lost(
            artifact,
            f"re-running the producer gave other bytes (sha256 {digest[:12]}, published "
            f"{artifact.sha256[:12]}): the source data changed since the publish",
        )
    return _put_back(artifact, ctx.produced, "restored")


def _put_back(artifact: Artifact, data: bytes, outcome: str) -> str:
    # The row lock makes concurrent restores of one artifact take turns (a stale marker
    # can let a second one start): the second finds the file intact and writes nothing.
    with transaction.atomic():
        locked = Artifact.objects.select_for_update().get(pk=artifact.pk)
        if locked.state == Artifact.State.LOST:
            return "lost"
        if artifacts.is_intact(locked):
            return "intact"
        artifacts.put_back(locked, data)
        Artifact.objects.filter(pk=locked.pk).update(
            rewrites=F("rewrites") + 1, verified_at=timezone.now()
        )
    log.info("artifact=%s job=%s %s the published bytes", artifact.pk, artifact.job_id, outcome)
    return outcome


def _mark_lost(artifact: Artifact, reason: str) -> str:
    with transaction.atomic():
        locked = Artifact.objects.select_for_update().get(pk=artifact.pk)
        if locked.state == Artifact.State.LOST:
            return "lost"
        if artifacts.is_intact(locked):
            return "intact"  # put back meanwhile (an operator, a replica sync)
        Artifact.objects.filter(pk=locked.pk).update(
            state=Artifact.State.LOST, lost_reason=reason[:300]
        )
    log.warning("artifact=%s job=%s marked lost", artifact.pk, artifact.job_id)
    return "lost"
