"""Pruning orphans meets a requeue: a file a requeued job may publish is never deleted.

The prune lists candidates first and deletes later; in between an operator can
requeue the file's job (dead → queued), and its next delivery reuses the very file
(identical bytes) and publishes a row naming it. Each file is looked at again, under
its job's row lock, as it is deleted.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from django.db import connection

from jobs import artifacts, retention
from jobs.models import Artifact, Job
from tests.jobs.helpers import new_job


def _dead_job_with_an_orphan() -> tuple[Job, str]:
    job = new_job(kind="test.short")
    stored = artifacts.store(job, b"orphan bytes", content_type="text/plain", extension="txt")
    Job.objects.filter(pk=job.pk).update(state=Job.State.DEAD)
    path = artifacts.get_storage().path(stored.artifact.storage_name)
    os.utime(path, (time.time() - 3600, time.time() - 3600))  # past any grace
    return job, stored.artifact.storage_name


@pytest.fixture(autouse=True)
def _short_grace(settings):
    settings.JOBS_ORPHAN_GRACE_SECONDS = 60


@pytest.mark.django_db
def test_prune_orphans__a_still_finished_jobs_orphan_is_deleted():
    _job, name = _dead_job_with_an_orphan()
    assert name in retention.orphans(older_than_seconds=60)
    assert retention.prune_orphans() == 1
    assert not artifacts.get_storage().exists(name)


@pytest.mark.django_db
def test_prune_orphans__a_job_requeued_after_the_listing_keeps_its_file(monkeypatch):
    job, name = _dead_job_with_an_orphan()
    listed = retention.orphans

    def listing_then_requeue(**kwargs):
        found = listed(**kwargs)
        Job.objects.filter(pk=job.pk).update(state=Job.State.QUEUED)  # the operator's requeue
        return found

    monkeypatch.setattr(retention, "orphans", listing_then_requeue)
    assert retention.prune_orphans() == 0
    assert artifacts.get_storage().exists(name), "its next delivery may publish this file"


@pytest.mark.django_db
def test_prune_orphans__a_row_written_after_the_listing_keeps_its_file(monkeypatch):
    job, name = _dead_job_with_an_orphan()
    listed = retention.orphans

    def listing_then_publish(**kwargs):
        found = listed(**kwargs)
        Artifact.objects.create(
            job=job,
            key=artifacts.artifact_key(job),
            storage_name=name,
            sha256=artifacts.sha256_hex(b"orphan bytes"),
            size=12,
            content_type="text/plain",
        )
        return found

    monkeypatch.setattr(retention, "orphans", listing_then_publish)
    assert retention.prune_orphans() == 0
    assert artifacts.get_storage().exists(name)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_prune_orphans__a_requeue_waits_while_the_file_is_deleted(monkeypatch):
    """On another session, the requeue's CAS waits for the prune's lock on the job row."""
    job, name = _dead_job_with_an_orphan()
    storage = artifacts.get_storage()
    deleting, requeued = threading.Event(), {}
    real_delete = type(storage).delete

    def slow_delete(self, file_name):
        deleting.set()
        time.sleep(0.5)  # the requeue on the other session arrives now
        real_delete(self, file_name)
        requeued["file_gone_before_requeue"] = not requeued.get("done")

    monkeypatch.setattr(type(storage), "delete", slow_delete)

    def requeue():
        try:
            assert deleting.wait(20)
            Job.objects.filter(pk=job.pk, state=Job.State.DEAD).update(state=Job.State.QUEUED)
            requeued["done"] = True
        finally:
            connection.close()

    other = threading.Thread(target=requeue)
    other.start()
    assert retention.prune_orphans() == 1
    other.join(20)
    assert requeued == {"file_gone_before_requeue": True, "done": True}
    assert not storage.exists(name)
    assert Job.objects.get(pk=job.pk).state == Job.State.QUEUED
