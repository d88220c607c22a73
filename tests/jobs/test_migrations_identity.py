"""Migration 0024 over a database made before it: every existing job keeps its keys.

A key already sent to a provider and an object already in the bucket must keep their
names after the upgrade: a pending notice sent again under another key would be a
second notice, and an artifact row whose key changed would no longer name its object.
The rows are made with the models as they were at 0023 and today's (id-derived)
derivations written out here, then the app migrates forward.
"""

from __future__ import annotations

import hashlib
import importlib

import pytest
from django.core.files.base import ContentFile
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from jobs import artifacts, identity, retention
from jobs.engine import effect_machine
from jobs.models import Artifact, Effect, Job

BEFORE = [("jobs", "0023_notice_in_app_message_words")]
# Forward to the latest (0024 and what came after it): the rows are then read with
# today's models, which know the later columns too (0027's ``reconciled_at``).
AFTER = None

pytestmark = pytest.mark.django_db(transaction=True)


def _migrate(targets) -> MigrationExecutor:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes() if targets is None else targets)
    return executor


@pytest.fixture
def before_0024():
    """The database at 0023; migrated back to the latest afterwards, whatever happens."""
    executor = _migrate(BEFORE)
    try:
        yield executor.loader.project_state(BEFORE).apps
    finally:
        _migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())


def _old_rows(apps, *, state: str, subject: str, with_outputs: bool) -> dict:
    """A job as the code before 0024 wrote it, with the keys it derived from the id."""
    OldJob = apps.get_model("jobs", "Job")
    job = OldJob.objects.create(
        kind="test.steps", subject_type="auth.user", subject_id=subject, output_revision=29,
        state=state, max_attempts=5,
    )  # fmt: skip
    made = {"pk": job.pk}
    if not with_outputs:
        return made
    key = f"job-{job.pk}-rev-29"
    sha = hashlib.sha256(b"published bytes").hexdigest()
    name = f"jobs/test-steps/{key}-{sha[:12]}.pdf"
    apps.get_model("jobs", "Artifact").objects.create(
        job=job, key=key, storage_name=name, sha256=sha, size=15, content_type="application/pdf"
    )
    effect_id = f"{job.pk}:29:completion-notice:47"
    idem = "fx-" + hashlib.sha256(effect_id.encode()).hexdigest()[:40]
    apps.get_model("jobs", "Effect").objects.create(
        job=job, effect_id=effect_id, name="completion-notice", provider="webhook",
        recipient="47", idempotency_key=idem, state="pending", data={},
    )  # fmt: skip
    made.update(key=key, name=name, sha=sha, effect_id=effect_id, idem=idem)
    return made


def test_migration_0024__existing_jobs_keep_their_keys_and_object_names(before_0024, monkeypatch):
    published = _old_rows(before_0024, state="succeeded", subject="1", with_outputs=True)
    waiting = _old_rows(before_0024, state="queued", subject="2", with_outputs=False)
    third = _old_rows(before_0024, state="dead", subject="3", with_outputs=False)
    monkeypatch.setattr(importlib.import_module("jobs.migrations.0024_job_uid"), "BATCH", 2)

    _migrate(AFTER)

    job = Job.objects.get(pk=published["pk"])
    assert job.keys_from_id is True and job.uid is not None and job.uid.version == 7
    artifact, effect = Artifact.objects.get(job=job), Effect.objects.get(job=job)
    # The stored rows are untouched, and what the code derives again matches them.
    assert (artifact.key, artifact.storage_name) == (published["key"], published["name"])
    assert (effect.effect_id, effect.idempotency_key) == (published["effect_id"], published["idem"])
    assert artifacts.artifact_key(job) == published["key"]
    assert artifacts.storage_name_for(job, "pdf", published["sha"]) == published["name"]
    derived = effect_machine.effect_identity(job, "completion-notice", "47")
    assert derived == published["effect_id"]
    assert effect_machine.idempotency_key(derived) == published["idem"]
    # A job that had published nothing yet keeps the id-derived keys it would have had.
    old_waiting = Job.objects.get(pk=waiting["pk"])
    assert old_waiting.keys_from_id is True
    assert artifacts.artifact_key(old_waiting) == f"job-{old_waiting.pk}-rev-29"
    uids = set(Job.objects.filter(keys_from_id=True).values_list("uid", flat=True))
    assert len(uids) == 3 and None not in uids, "every batch dated its jobs"
    assert Job.objects.get(pk=third["pk"]).uid.version == 7

    new = Job.objects.create(kind="test.steps", subject_type="auth.user", subject_id="3")
    assert new.keys_from_id is False
    assert artifacts.artifact_key(new) == f"job-{new.uid}-rev-1"


def test_migration_0024__an_old_jobs_files_are_still_told_by_its_id(before_0024):
    """Pruning still finds the job of a file named before the upgrade."""
    live = _old_rows(before_0024, state="retry_wait", subject="1", with_outputs=False)
    _migrate(AFTER)
    job = Job.objects.get(pk=live["pk"])
    name = artifacts.storage_name_for(job, "pdf", "0" * 64)
    assert name == f"jobs/test-steps/job-{job.pk}-rev-29-000000000000.pdf"
    artifacts.get_storage().save(name, ContentFile(b"x"))
    assert identity.job_lookup(name) == {"pk": job.pk, "keys_from_id": True}
    assert name not in retention.orphans(), "its job is live: the file may still be published"
