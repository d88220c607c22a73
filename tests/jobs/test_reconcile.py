"""What a failover lost, as the artifact storage shows it (issue 47, part 3: a start)."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from jobs import artifacts, manifests, reconcile, retention
from jobs.delivery.runner import run_delivery
from jobs.models import Artifact, Effect, Job
from tests.jobs.helpers import lose_job, new_job

pytestmark = pytest.mark.django_db


def test_lost_jobs__an_object_whose_job_row_is_gone_names_the_lost_job(make_user):
    kept, lost = new_job(make_user()), new_job(make_user())
    for job in (kept, lost):
        assert run_delivery(job.pk, worker="w-old-primary").outcome == "succeeded"
    lost_file = Artifact.objects.get(job=lost).storage_name
    lose_job(lost)  # the promoted standby never had it

    [found] = reconcile.lost_jobs()
    assert found.job == str(lost.uid)
    assert (found.kind_folder, found.revision, found.objects) == ("test-steps", 1, (lost_file,))
    assert abs(found.made_at - timezone.now()) < timedelta(minutes=1), "dated by its uid"


def test_lost_jobs__a_late_writers_orphan_of_a_known_job_is_not_lost(make_user):
    job = new_job(make_user())
    assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    published = Artifact.objects.get(job=job).storage_name
    late = published.replace(".txt", "-a1b2c3.txt")  # another name of the same job
    assert reconcile.lost_jobs([published, late, "jobs/other/readme.txt"]) == []


def test_lost_jobs__a_name_from_before_0024_is_told_by_the_id_of_an_old_job(make_user):
    job = new_job(make_user())  # made after 0024: its id does not claim id-named files
    name = f"jobs/test-steps/job-{job.pk}-rev-1-000000000000.txt"
    [found] = reconcile.lost_jobs([name])
    assert (found.job, found.made_at) == (str(job.pk), None)


def test_jobs_reconcile_command__lists_them(make_user):
    lost = new_job(make_user())
    assert run_delivery(lost.pk, worker="w-old-primary").outcome == "succeeded"
    lose_job(lost)
    out = StringIO()
    call_command("jobs_reconcile", "--dry-run", stdout=out)
    assert f"lost job {lost.uid} kind=test-steps revision=1" in out.getvalue()
    assert out.getvalue().rstrip().endswith("lost jobs: 1")
    out = StringIO()
    call_command("jobs_reconcile", "--json", "--dry-run", stdout=out)
    [entry] = json.loads(out.getvalue())["lost_jobs"]
    assert entry["job"] == str(lost.uid) and len(entry["objects"]) == 1


def test_unknown_keys__a_key_the_provider_accepted_for_a_lost_job(make_user, tmp_path):
    kept, lost = new_job(make_user()), new_job(make_user())
    for job in (kept, lost):
        assert run_delivery(job.pk, worker="w-old-primary").outcome == "succeeded"
    sent = {e.idempotency_key: e.effect_id for e in Effect.objects.all()}  # the provider's
    lost_effect = Effect.objects.get(job=lost)
    lose_job(lost)

    export = tmp_path / "accepted.txt"
    export.write_text(
        "# the provider's export\n\n" + "".join(f"{k} {e}\n" for k, e in sent.items())
    )
    accepted = reconcile.read_provider_keys(export.read_text().splitlines())
    [unknown] = reconcile.unknown_keys(accepted)
    assert unknown.idempotency_key == lost_effect.idempotency_key
    assert (unknown.effect_id, unknown.job) == (lost_effect.effect_id, str(lost.uid))

    out = StringIO()
    call_command("jobs_reconcile", "--dry-run", "--provider-keys", str(export), stdout=out)
    text = out.getvalue()
    assert f"accepted key {lost_effect.idempotency_key} effect={lost_effect.effect_id}" in text
    assert f"lost job {lost.uid}" in text
    assert text.rstrip().endswith("accepted keys not in the ledger: 1")
    out = StringIO()
    call_command(
        "jobs_reconcile", "--json", "--dry-run", "--provider-keys", str(export), stdout=out
    )
    [entry] = json.loads(out.getvalue())["unknown_keys"]
    assert entry["job"] == str(lost.uid)


# --- identity manifests: what a lost job is asked for again with ---------------------


@pytest.fixture
def no_xattrs(monkeypatch):
    """A filesystem that keeps no user extended attributes (the probe says so)."""
    monkeypatch.setattr(artifacts.AtomicFileSystemStorage, "attaches_identity", lambda s: False)


def test_identity__carried_by_the_artifact_itself_ids_only_no_file_of_its_own(make_user):
    job = new_job(make_user())
    assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    storage = artifacts.get_storage()
    assert storage.attaches_identity(), "this machine's filesystem keeps user xattrs"
    (row,) = Artifact.objects.filter(job=job)
    data = artifacts.read_identity(storage, row.storage_name)
    assert data == manifests.body_for(Job.objects.get(pk=job.pk)), "a pure function of it"
    found = manifests.parse_attached(data, str(job.uid), 1)
    assert (found.kind, found.subject_type, found.subject_id) == (
        "test.steps",
        "auth.user",
        job.subject_id,
    )
    assert not storage.exists(manifests.name_for(job)), "no manifest file, no fsync of its own"
    assert manifests.parse_attached(data, str(job.uid), 2) is None, "another revision's"
    assert manifests.parse_attached(b"not json", str(job.uid), 1) is None


def test_identity__a_lost_jobs_object_tells_it_without_a_manifest_file(make_user):
    job = new_job(make_user())
    assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    lose_job(job)
    (lost,) = reconcile.lost_jobs()
    assert lost.job == str(job.uid)
    assert lost.manifest is not None and lost.manifest.kind == "test.steps"
    assert lost.manifest.subject_id == str(job.subject_id)


def test_identity__too_large_for_the_object_goes_to_a_manifest_file(make_user, monkeypatch):
    monkeypatch.setattr(manifests, "ATTACHED_MAX", 10)
    job = new_job(make_user())
    assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    storage = artifacts.get_storage()
    (row,) = Artifact.objects.filter(job=job)
    assert artifacts.read_identity(storage, row.storage_name) is None
    assert storage.exists(manifests.name_for(job))


def test_manifest__without_xattrs_stored_beside_the_first_object_ids_only(make_user, no_xattrs):
    job = new_job(make_user())
    assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    name = manifests.name_for(job)
    assert name == f"jobs/.identity/job-{job.uid}-rev-1.json"
    with artifacts.get_storage().open(name, "rb") as fh:
        data = fh.read()
    assert data == manifests.body_for(Job.objects.get(pk=job.pk)), "a pure function of it"
    found = manifests.parse(name, data)
    assert (found.kind, found.subject_type, found.subject_id) == (
        "test.steps",
        "auth.user",
        job.subject_id,
    )
    assert name not in retention.orphans(), "an identity, not an orphan"
    assert manifests.parse(name.replace("rev-1", "rev-2"), data) is None, "name and body differ"
    (row,) = Artifact.objects.filter(job=job)
    assert artifacts.read_identity(artifacts.get_storage(), row.storage_name) is None


def test_prune_manifests__a_finished_jobs_goes_after_the_grace_a_lost_jobs_stays(
    make_user, settings, no_xattrs
):
    settings.JOBS_ORPHAN_GRACE_SECONDS = 0
    kept, lost = new_job(make_user()), new_job(make_user())
    for job in (kept, lost):
        assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    lose_job(lost)
    assert retention.prune_manifests() == 1
    storage = artifacts.get_storage()
    assert not storage.exists(manifests.name_for(kept))
    assert storage.exists(manifests.name_for(lost)), "the evidence a reconcile asks with"


# --- the maintenance loop: once per timeline change ------------------------------------


def test_timeline_watch__reconciles_once_when_the_timeline_changes(monkeypatch, make_user):
    from jobs.models import ReconcileMark
    from jobs.reconcile import timeline

    now = {"timeline": 1}
    monkeypatch.setattr(timeline, "server_timeline", lambda: now["timeline"])
    monkeypatch.setattr(timeline, "CHECK_EVERY", 0.0)
    monkeypatch.setattr(timeline, "_next_check", 0.0)
    assert timeline.watch(worker="h1") == "", "the first look only records the timeline"
    lost = new_job(make_user())
    assert run_delivery(lost.pk, worker="w-old-primary").outcome == "succeeded"
    lose_job(lost)
    assert timeline.watch(worker="h1") == "", "same timeline: nothing to do"
    now["timeline"] = 2  # promoted
    line = timeline.watch(worker="h1")
    assert line.startswith("timeline 1->2 lost=1 asked_again=1")
    assert Job.objects.get(uid=lost.uid).reconciled_at is not None
    mark = ReconcileMark.objects.get()
    assert (mark.timeline, mark.claimed_by, mark.claimed_until) == (2, "", None)
    assert timeline.watch(worker="h2") == "", "reconciled once"


def test_timeline_watch__a_claim_held_by_another_host_is_left_to_it(monkeypatch):
    from jobs.models import ReconcileMark
    from jobs.reconcile import timeline

    monkeypatch.setattr(timeline, "server_timeline", lambda: 3)
    monkeypatch.setattr(timeline, "_next_check", 0.0)
    ReconcileMark.objects.create(
        name=timeline.MARK,
        timeline=2,
        claimed_by="h1",
        claimed_until=timezone.now() + timedelta(minutes=5),
    )
    assert timeline.watch(worker="h2") == ""
    assert ReconcileMark.objects.get().timeline == 2


def test_server_timeline__read_from_the_control_data():
    from django.db import connection

    from jobs.reconcile import timeline

    found = timeline.server_timeline()
    if connection.vendor == "postgresql":
        assert isinstance(found, int) and found >= 1
    else:
        assert found is None


def test_reconcile__a_lost_job_asked_for_since_is_left_as_it_is(make_user):
    user = make_user()
    lost = new_job(user)
    assert run_delivery(lost.pk, worker="w-old-primary").outcome == "succeeded"
    lose_job(lost)
    since = new_job(user)  # the same identity, asked for after the failover: a new uid
    report = reconcile.reconcile(ask_providers=False)
    assert report.outcomes[str(lost.uid)] == ("asked_already", since.pk)
    assert Job.objects.count() == 1 and Job.objects.get().uid == since.uid
