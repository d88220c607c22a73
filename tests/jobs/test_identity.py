"""Identities no failover can hand out twice (issue 47): keys derive from the job's uid.

A promoted asynchronous replica resumes the job id sequence below what the lost primary
used, so a new job can get a lost job's id. Its artifact key, object name, effect id and
idempotency key must still be its own: with the same kind, revision and recipient, a key
derived from the id would reach the provider as a replay of the lost notice.
"""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from jobs import artifacts, identity, retention
from jobs.delivery.runner import run_delivery
from jobs.engine import effect_machine
from jobs.models import Artifact, Effect, Job
from tests.jobs.helpers import lose_job, new_job

pytestmark = pytest.mark.django_db


def test_uuid7__version_variant_and_time_order():
    first = identity.uuid7(1_700_000_000_000)
    later = identity.uuid7(1_700_000_000_001)
    assert first.version == 7 and first.variant == uuid.RFC_4122
    assert first.int >> 80 == 1_700_000_000_000  # the milliseconds lead
    assert first < later
    made = {identity.uuid7(1_700_000_000_000) for _ in range(1000)}
    assert len(made) == 1000, "the random bits keep one millisecond's uids apart"


def test_job__gets_its_uid_once_at_insert(make_user):
    job = new_job(make_user())
    stored = Job.objects.get(pk=job.pk)
    assert stored.uid == job.uid and stored.uid.version == 7
    assert stored.keys_from_id is False
    assert new_job(make_user()).uid != job.uid


def _outputs(job: Job) -> dict[str, object]:
    """What the job's delivery handed out: the keys and names that leave the database."""
    artifact = Artifact.objects.get(job=job)
    effect = Effect.objects.get(job=job)
    return {
        "artifact key": artifact.key,
        "object name": artifact.storage_name,
        "effect id": effect.effect_id,
        "idempotency key": effect.idempotency_key,
    }


def _rewind_job_ids(to: int) -> None:
    """The next job gets id ``to``, as after a failover to a replica that was behind."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence(%s, 'id'), %s, false)",
            [Job._meta.db_table, to],
        )


@pytest.mark.postgres
def test_rewound_sequence__reused_id_gets_keys_and_object_names_of_its_own(make_user):
    """The run in the issue: same kind, same revision, same recipient, another subject,
    the lost job's id. Nothing the new job hands out may equal what the lost one did
    (its bytes are the same too: the kind writes the job id into them)."""
    reviewer, other_subject = make_user(), make_user()
    lost = new_job(reviewer)
    assert run_delivery(lost.pk, worker="w-old-primary").outcome == "succeeded"
    lost_outputs = _outputs(lost)
    lost_file = lost_outputs["object name"]
    assert artifacts.get_storage().exists(lost_file)  # the bucket kept it; the rows are gone

    lose_job(lost)
    _rewind_job_ids(lost.pk)
    new = new_job(reviewer, subject=other_subject.pk)
    assert new.pk == lost.pk, "the rewound sequence handed the id out again"
    assert run_delivery(new.pk, worker="w-new-primary").outcome == "succeeded"

    new_outputs = _outputs(new)
    same = [what for what in lost_outputs if new_outputs[what] == lost_outputs[what]]
    assert same == [], f"handed out twice after the rewind: {same}"
    assert new.uid != lost.uid
    assert artifacts.get_storage().exists(lost_file), "the lost job's object is left alone"


@pytest.mark.postgres
def test_rewound_sequence__lost_jobs_object_is_an_orphan_not_the_new_jobs(make_user):
    """Pruning tells files by their job's uid: a live new job under a reused id does not
    keep the lost job's object alive (by id it did, for as long as the new job lived)."""
    lost = new_job(make_user())
    assert run_delivery(lost.pk, worker="w-old-primary").outcome == "succeeded"
    lost_file = Artifact.objects.get(job=lost).storage_name
    lose_job(lost)
    _rewind_job_ids(lost.pk)
    waiting = new_job(make_user())  # queued: its files would be kept
    assert waiting.pk == lost.pk
    assert lost_file in retention.orphans()


def test_keys__derive_from_the_uid_not_the_id(make_user):
    job = new_job(make_user())
    twin = Job(pk=job.pk, uid=identity.uuid7(), output_revision=job.output_revision, kind=job.kind)
    assert artifacts.artifact_key(job) != artifacts.artifact_key(twin)
    assert effect_machine.effect_identity(job, "n", "7") != effect_machine.effect_identity(
        twin, "n", "7"
    )
    assert artifacts.artifact_key(job) == f"job-{job.uid}-rev-{job.output_revision}"
    assert identity.display_name(job) == f"job-{job.pk}-rev-{job.output_revision}"


def test_job_lookup__a_name_finds_its_own_job_only():
    uid = identity.uuid7()
    assert identity.job_lookup(f"jobs/k/job-{uid}-rev-2-0123456789ab.pdf") == {"uid": uid}
    assert identity.job_lookup("jobs/k/job-84-rev-29-0123456789ab.pdf") == {
        "pk": 84,
        "keys_from_id": True,
    }
    assert identity.job_lookup("jobs/k/other.pdf") is None
