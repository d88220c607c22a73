"""Restores never change published bytes (issue 18).

A restore may only put back bytes whose sha256 equals the row's: from the replica
storage, or from the producer when today's data still gives the published bytes.
Otherwise the artifact is lost, the reviewer is told to rebuild it as a new revision,
and nothing is served. One restore is in flight however many downloads find the file bad.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import Group
from django.db import connection
from django.test import Client
from django.utils import timezone
from django_q.models import OrmQ

from jobs import artifacts, registry
from jobs.delivery.runner import run_delivery
from jobs.exceptions import ArtifactLost, StorageUnavailable, TemporaryFailure
from jobs.models import Artifact, Job
from jobs.queue import enqueue_restore
from jobs.restore import restore_artifact
from permits.services import report_request
from tests.permits import factories

pytestmark = pytest.mark.django_db


@pytest.fixture
def reviewer(make_user):
    user = make_user(username="restore-reviewer")
    user.groups.add(Group.objects.get(name="reviewers"))
    return user


def finished_report(permit) -> Artifact:
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "succeeded"
    return Artifact.objects.get(job=job)


def corrupt(artifact: Artifact) -> None:
    Path(artifacts.get_storage().path(artifact.storage_name)).write_bytes(b"%PDF-1.4 forged")


def rename_office(permit) -> None:
    permit.tenant.name = f"{permit.tenant.name} (renamed)"
    permit.tenant.save(update_fields=["name"])


def restore_messages() -> int:
    return sum("restore" in m.func() for m in OrmQ.objects.all())


def download(user, permit):
    client = Client()
    client.force_login(user)
    return client.get(f"/requests/{permit.pk}/report/")


def test_restore__source_data_changed__lost_not_rewritten_and_one_restore_in_flight(reviewer):
    permit = factories.permit(reviewer=reviewer)
    artifact = finished_report(permit)
    published = (artifact.sha256, artifact.size, artifact.storage_name)
    rename_office(permit)  # today's report would differ from the published one
    corrupt(artifact)

    for _ in range(20):
        response = download(reviewer, permit)
        assert response.status_code == 503 and b"%PDF" not in response.content
    assert restore_messages() == 1, "one restore in flight however many downloads"

    assert restore_artifact(artifact.pk) == "lost"
    artifact.refresh_from_db()
    assert (artifact.sha256, artifact.size, artifact.storage_name) == published
    assert artifact.state == Artifact.State.LOST and artifact.rewrites == 0
    assert "source data changed" in artifact.lost_reason
    assert published[0][:12] in artifact.lost_reason, "ids and hashes only"
    assert artifact.restore_requested_at is None, "the task clears the marker"
    with pytest.raises(ArtifactLost):
        artifacts.read_verified(artifact)

    response = download(reviewer, permit)
    assert response.status_code == 410
    page = response.content.decode()
    assert "can no longer be produced" in page and "new revision" in page
    assert "%PDF" not in page
    assert restore_messages() == 1, "a lost artifact queues no restore"
    assert restore_artifact(artifact.pk) == "lost"


def test_restore__unchanged_data__puts_the_published_bytes_back(reviewer):
    permit = factories.permit(reviewer=reviewer)
    artifact = finished_report(permit)
    good = Path(artifacts.get_storage().path(artifact.storage_name)).read_bytes()
    corrupt(artifact)
    assert download(reviewer, permit).status_code == 503

    assert restore_artifact(artifact.pk) == "restored"
    artifact.refresh_from_db()
    assert artifact.state == Artifact.State.STORED and artifact.rewrites == 1
    assert artifacts.read_verified(artifact) == good
    assert hashlib.sha256(good).hexdigest() == artifact.sha256
    response = download(reviewer, permit)
    assert response.status_code == 200
    assert hashlib.sha256(b"".join(response.streaming_content)).hexdigest() == artifact.sha256


def test_restore__from_the_replica_even_when_the_source_data_changed(reviewer, settings, tmp_path):
    settings.STORAGES = {
        **settings.STORAGES,
        "replica": {
            "BACKEND": "jobs.artifacts.AtomicFileSystemStorage",
            "OPTIONS": {"location": str(tmp_path / "replica")},
        },
    }
    settings.JOBS_ARTIFACT_REPLICA_STORAGE = "replica"
    permit = factories.permit(reviewer=reviewer)
    artifact = finished_report(permit)
    replica = artifacts.get_replica_storage()
    assert artifacts.read_verified(artifact, storage=replica), "store() wrote the replica too"
    rename_office(permit)
    artifacts.get_storage().delete(artifact.storage_name)

    assert restore_artifact(artifact.pk) == "restored_from_replica"
    artifact.refresh_from_db()
    assert artifact.state == Artifact.State.STORED
    assert artifacts.is_intact(artifact)


def test_restore__a_transient_producer_failure_does_not_mark_the_artifact_lost(
    reviewer, monkeypatch
):
    permit = factories.permit(reviewer=reviewer)
    artifact = finished_report(permit)
    corrupt(artifact)
    kind = registry.get_kind(artifact.job.kind)

    def unavailable(ctx):
        raise TemporaryFailure("database unavailable", code="db_down")

    monkeypatch.setitem(registry._kinds, kind.name, dataclasses.replace(kind, handler=unavailable))
    assert enqueue_restore(artifact)
    assert restore_artifact(artifact.pk) == "failed:temporary"
    artifact.refresh_from_db()
    assert artifact.state == Artifact.State.STORED and artifact.lost_reason == ""
    assert artifact.restore_requested_at is None, "a later reader may ask again"
    assert enqueue_restore(artifact)


def test_enqueue_restore__a_stale_marker_allows_a_new_request(reviewer):
    permit = factories.permit(reviewer=reviewer)
    artifact = finished_report(permit)
    assert enqueue_restore(artifact) and not enqueue_restore(artifact)
    Artifact.objects.filter(pk=artifact.pk).update(
        restore_requested_at=timezone.now() - timedelta(hours=1)
    )
    assert enqueue_restore(artifact), "a restore that never finished does not block forever"
    assert restore_messages() == 2


def test_restore__of_an_unfinished_job_is_left_to_its_worker(reviewer):
    permit = factories.permit(reviewer=reviewer)
    artifact = finished_report(permit)
    corrupt(artifact)
    Job.objects.filter(pk=artifact.job_id).update(state=Job.State.QUEUED)
    assert restore_artifact(artifact.pk) == "not_finished"
    assert Artifact.objects.get(pk=artifact.pk).state == Artifact.State.STORED


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_enqueue_restore__concurrent_requests_queue_one_restore(make_user):
    permit = factories.permit(reviewer=make_user())
    artifact = finished_report(permit)
    barrier = threading.Barrier(8)
    won = []

    def ask():
        try:
            barrier.wait()
            won.append(enqueue_restore(artifact))
        finally:
            connection.close()

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(won) == [False] * 7 + [True]
    assert restore_messages() == 1


# --- a storage that cannot be read now is not a corrupt file ------------------------------


class _FailingRead:
    """A stored file whose read fails after the first chunk with ``err`` (a disk error)."""

    def __init__(self, fh, err: int):
        self.fh, self.err, self.reads = fh, err, 0

    def read(self, size: int = -1) -> bytes:
        self.reads += 1
        if self.reads > 1:
            raise OSError(self.err, "Input/output error", "/srv/artifacts/secret-name.pdf")
        return self.fh.read(size)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def failing_disk(monkeypatch, err: int = errno.EIO) -> None:
    real = artifacts._open_read
    monkeypatch.setattr(artifacts, "CHUNK", 64)  # the report is read in several chunks
    monkeypatch.setattr(
        artifacts, "_open_read", lambda storage, name: _FailingRead(real(storage, name), err)
    )


def test_disk_error_mid_read__503_and_no_restore__the_file_is_not_judged(
    reviewer, monkeypatch, caplog
):
    artifact = finished_report(factories.permit(reviewer=reviewer))
    OrmQ.objects.all().delete()
    failing_disk(monkeypatch)
    with pytest.raises(StorageUnavailable, match=r"artifact storage read failed \(EIO\)"):
        artifacts.open_verified(artifact)
    client = Client()
    client.force_login(reviewer)
    response = client.get(f"/requests/{artifact.job.subject_id}/report/")
    assert response.status_code == 503 and response["Retry-After"] == "60"
    assert restore_messages() == 0, "intact bytes are not restored"
    assert "storage unavailable at download (artifact storage read failed (EIO))" in caplog.text
    assert "secret-name" not in caplog.text and "failed its sha256 check" not in caplog.text
    monkeypatch.undo()
    assert artifacts.is_intact(artifact), "the bytes were intact all along"


def test_disk_error__restore_postponed_not_lost__admin_verify_does_not_judge(
    reviewer, monkeypatch, admin_client
):
    artifact = finished_report(factories.permit(reviewer=reviewer))
    Artifact.objects.filter(pk=artifact.pk).update(restore_requested_at=timezone.now())
    failing_disk(monkeypatch, errno.EACCES)  # also a permission an operator changed
    assert restore_artifact(artifact.pk) == "failed:temporary"
    artifact.refresh_from_db()
    assert artifact.state == Artifact.State.STORED and artifact.restore_requested_at is None

    answer = admin_client.post(
        "/admin/jobs/artifact/",
        {"action": "verify", "_selected_action": [artifact.pk]},
        follow=True,
    )
    said = [str(m) for m in answer.context["messages"]]
    assert any("Could not be read now, so not judged" in m and "EACCES" in m for m in said), said
    assert not any("intact" in m or "Missing or corrupt" in m for m in said), said


def test_missing_file__still_corrupt_and_restored(reviewer):
    """The other side of the line: no file under the name is a verdict (restore)."""
    artifact = finished_report(factories.permit(reviewer=reviewer))
    Path(artifacts.get_storage().path(artifact.storage_name)).unlink()
    assert not artifacts.is_intact(artifact)
    assert restore_artifact(artifact.pk) == "restored"
