"""The archive pass (issue 46): long-finished jobs leave, their identities stay, for any age.

A request for an archived identity returns the same job id and final state without a row
or a message; a redelivery or a stale worker of an archived job publishes and sends
nothing; the pass keeps its window, skips live jobs and unsettled effects, and runs
idempotently (and, on PostgreSQL, concurrently: each job archived once).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

import jobs
from jobs import archive, artifacts, retention
from jobs.delivery.runner import claim_for, run_claim, run_delivery
from jobs.models import (
    ArchivedJob,
    Artifact,
    Attempt,
    Effect,
    EffectEvent,
    Job,
    JobStep,
    Notice,
)
from jobs.reconcile import evidence, outside
from jobs.tasks import release_effect, run_job
from tests.jobs.helpers import new_job

WINDOW = 30.0  # days: past every suite's redelivery safety window


def _finished(*, days_ago: float = 40, subject: int = 1, effects: tuple[str, ...] = ()) -> Job:
    """A succeeded job with its artifact, finished ``days_ago``, with effects in these states."""
    job = new_job(subject=subject)  # no recipients: no in-app notice
    assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    for n, state in enumerate(effects):
        effect_id = f"{job.uid}:1:hook:{n}"
        effect = Effect.objects.create(
            job=job,
            effect_id=effect_id,
            name="hook",
            provider="webhook",
            recipient=str(n),
            idempotency_key=f"key-{effect_id}",
            state=state,
        )
        EffectEvent.objects.create(effect=effect, provider="webhook", action="send", actor="w1")
    Job.objects.filter(pk=job.pk).update(finished_at=timezone.now() - timedelta(days=days_ago))
    job.refresh_from_db()
    return job


def _messages() -> int:
    from django_q.models import OrmQ

    return OrmQ.objects.count()


@pytest.mark.django_db
def test_archive__writes_the_record_and_deletes_the_rows():
    job = _finished(effects=("applied", "withheld"))
    artifact = Artifact.objects.get(job=job)
    done = archive.archive(older_than_days=WINDOW)
    assert (done.jobs, done.effects) == (1, 2)
    record = ArchivedJob.objects.get(uid=job.uid)
    assert (record.job_id, record.state, record.finished_at) == (
        job.pk,
        "succeeded",
        job.finished_at,
    )
    assert (record.artifact_key, record.artifact_name, record.artifact_sha256) == (
        artifact.key,
        artifact.storage_name,
        artifact.sha256,
    )
    assert record.effects == {
        e: [f"key-{e}", s]
        for e, s in [(f"{job.uid}:1:hook:0", "applied"), (f"{job.uid}:1:hook:1", "withheld")]
    }
    for model in (Job, Attempt, JobStep, Artifact, Effect, EffectEvent):
        assert not model.objects.exists(), model
    assert artifacts.get_storage().exists(artifact.storage_name), "the record names the file"


@pytest.mark.django_db
def test_archive__keeps_the_window_live_jobs_and_unsettled_effects():
    recent = _finished(days_ago=10, subject=1)
    unsettled = [
        _finished(subject=2 + n, effects=("applied", s))
        for n, s in enumerate(("pending", "sending", "unknown"))
    ]
    settled = _finished(subject=9, effects=("failed", "needs_review"))
    live = new_job(subject=10)  # queued
    Job.objects.filter(pk=live.pk).update(finished_at=timezone.now() - timedelta(days=40))
    assert archive.archive(older_than_days=WINDOW).jobs == 1
    assert set(ArchivedJob.objects.values_list("job_id", flat=True)) == {settled.pk}
    assert set(Job.objects.values_list("pk", flat=True)) == {
        recent.pk,
        live.pk,
        *(j.pk for j in unsettled),
    }
    assert Effect.objects.filter(job__in=unsettled).count() == 6


@pytest.mark.django_db
def test_archive__archives_a_job_with_an_in_app_notice_and_the_inbox_keeps_it(make_user):
    """The site's reports carry in-app notices: archived all the same, the notice stays
    in its recipient's inbox (its effect gone, the key in the record), and a redelivery
    of the archived job adds no second notice."""
    user = make_user()
    job = new_job(user)
    assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    notice = Notice.objects.get(effect__job=job)
    effect_id, key = notice.effect.effect_id, notice.effect.idempotency_key
    Job.objects.filter(pk=job.pk).update(finished_at=timezone.now() - timedelta(days=40))
    assert archive.archive(older_than_days=WINDOW).jobs == 1
    assert not Job.objects.filter(pk=job.pk).exists()
    kept = Notice.objects.get(pk=notice.pk)
    assert (kept.recipient_id, kept.title, kept.effect_id) == (user.pk, notice.title, None)
    record = ArchivedJob.objects.get(job_id=job.pk)
    assert record.effects[effect_id] == [key, Effect.State.APPLIED]
    assert run_delivery(job.pk, worker="w2").outcome != "succeeded"
    assert Notice.objects.filter(recipient=user).count() == 1


@pytest.mark.django_db
def test_archive__is_idempotent_and_batched():
    finished = [_finished(subject=n) for n in range(5)]
    done = archive.archive(older_than_days=WINDOW, batch=2)
    assert (done.jobs, done.batches) == (5, 3)
    before = list(ArchivedJob.objects.order_by("uid").values())
    again = archive.archive(older_than_days=WINDOW, batch=2)
    assert (again.jobs, again.batches) == (0, 1)
    assert list(ArchivedJob.objects.order_by("uid").values()) == before
    assert {r["job_id"] for r in before} == {j.pk for j in finished}


@pytest.mark.django_db
def test_archive__refuses_a_window_inside_the_redelivery_safety_window():
    with pytest.raises(ValueError, match="redelivery safety window"):
        archive.archive(older_than_days=retention.minimum_days() / 2)


def test_check_archive_days__names_the_setting(settings):
    settings.JOBS_ARCHIVE_AFTER_DAYS = 1
    assert [e.id for e in archive.check_archive_days()] == ["jobs.E042"]
    settings.JOBS_ARCHIVE_AFTER_DAYS = None
    assert archive.check_archive_days() == []


def test_check_archive_days__warns_when_retention_prunes_effects_first(settings):
    settings.JOBS_ARCHIVE_AFTER_DAYS = 60
    settings.JOBS_RETENTION_DAYS = 30
    assert [e.id for e in archive.check_archive_days()] == ["jobs.W021"]
    settings.JOBS_RETENTION_DAYS = 90
    assert archive.check_archive_days() == []


@pytest.mark.django_db
def test_request__an_archived_identity_returns_the_same_job_without_a_row_or_message():
    job = _finished(effects=("applied",))
    key = Artifact.objects.get(job=job).key
    archive.archive(older_than_days=WINDOW)
    messages = _messages()
    handle = jobs.request("test.steps", ("auth.user", 1), tenant="t1")
    assert (handle.archived, handle.created, handle.id, handle.state) == (
        True,
        False,
        job.pk,
        "succeeded",
    )
    assert handle.finished_at == job.finished_at and handle.is_finished
    assert handle.artifact.key == key and handle.artifact.sha256
    assert [(e.effect_id, e.state) for e in handle.effects] == [(f"{job.uid}:1:hook:0", "applied")]
    assert handle.refresh().state == "succeeded" and handle.result is None
    assert not Job.objects.exists() and _messages() == messages
    many = jobs.request_many([{"kind": "test.steps", "subject": ("auth.user", 1), "tenant": "t1"}])
    assert [(h.id, h.archived, h.created) for h in many] == [(job.pk, True, False)]
    assert not Job.objects.exists() and _messages() == messages


@pytest.mark.django_db
def test_handle__a_job_archived_after_its_handle_was_made_refreshes_to_its_record():
    job = _finished()
    handle = jobs.request("test.steps", ("auth.user", 1), tenant="t1")
    assert not handle.archived
    archive.archive(older_than_days=WINDOW)
    assert handle.refresh().archived and handle.id == job.pk and handle.state == "succeeded"


@pytest.mark.django_db
def test_run_job__a_redelivery_of_an_archived_job_publishes_and_sends_nothing():
    job = _finished(effects=("applied",))
    effect_pk = Effect.objects.get(job=job).pk
    archive.archive(older_than_days=WINDOW)
    assert run_job(job.pk) == "missing"
    assert release_effect(effect_pk) == "missing"
    for model in (Job, Attempt, Artifact, Effect, EffectEvent, Notice):
        assert not model.objects.exists(), model


@pytest.mark.django_db
def test_stale_worker__an_archived_jobs_late_publish_finds_no_row(make_user):
    user = make_user()
    job = new_job(user)
    claim = claim_for(job.pk, "w-stale")  # this worker then stalls past its lease
    assert claim.won
    # Meanwhile the job finished (another worker), long ago, and was archived.
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.SUCCEEDED, finished_at=timezone.now() - timedelta(days=40)
    )
    archive.archive(older_than_days=WINDOW)
    assert ArchivedJob.objects.filter(uid=job.uid).exists()
    result = run_claim(claim, "w-stale")
    assert (result.outcome, result.effects) == ("lease_lost", {})
    for model in (Job, Artifact, Effect, EffectEvent, Notice):
        assert not model.objects.exists(), model


@pytest.mark.django_db
def test_archived_effect__is_found_by_its_effect_id():
    job = _finished(effects=("applied",))
    archive.archive(older_than_days=WINDOW)
    effect_id = f"{job.uid}:1:hook:0"
    assert archive.archived_effect(effect_id) == (f"key-{effect_id}", "applied")
    assert archive.archived_effect(f"{job.uid}:1:hook:9") is None


@pytest.mark.django_db
def test_reconcile__a_provider_key_of_an_archived_effect_is_not_unknown():
    job = _finished(effects=("applied",))
    archive.archive(older_than_days=WINDOW)
    effect_id = f"{job.uid}:1:hook:0"
    found = outside.unknown_keys([(f"key-{effect_id}", effect_id), ("key-other", effect_id)])
    assert [u.idempotency_key for u in found] == ["key-other"], "a key the record lacks only"


@pytest.mark.django_db
def test_pruning__an_archived_jobs_file_is_no_orphan_and_its_job_is_not_lost(settings):
    settings.JOBS_ORPHAN_GRACE_SECONDS = 0
    job = _finished()
    name = Artifact.objects.get(job=job).storage_name
    archive.archive(older_than_days=WINDOW)
    assert name not in retention.orphans()
    assert retention.prune_orphans() == 0 and artifacts.get_storage().exists(name)
    assert str(job.uid) not in {lost.job for lost in evidence.lost_jobs()}


@pytest.mark.django_db
def test_archive_when_due__runs_once_per_interval(settings, monkeypatch):
    monkeypatch.setattr(archive, "_archived_at", float("-inf"))
    _finished()
    assert archive.archive_when_due() == 0  # the setting is off
    settings.JOBS_ARCHIVE_AFTER_DAYS = WINDOW
    assert archive.archive_when_due() == 1
    _finished(subject=2)
    assert archive.archive_when_due() == 0, "at most once an interval in a process"


@pytest.mark.django_db
def test_jobs_prune__archive_prints_counts_and_seconds(capsys):
    _finished(effects=("applied",))
    call_command("jobs_prune", "--archive-after", str(WINDOW), "--dry-run")
    assert "would archive 1 jobs" in capsys.readouterr().out
    call_command("jobs_prune", "--archive-after", str(WINDOW))
    out = capsys.readouterr().out
    assert "archived 1 jobs (1 effect identities) in 1 batches" in out and " s\n" in out


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_archive__two_concurrent_passes_archive_each_job_once():
    """Two hosts' passes at once (threads, each its own connection): SKIP LOCKED splits the
    jobs between them, and every job is archived by exactly one."""
    finished = [_finished(subject=n, effects=("applied",)) for n in range(24)]
    counts: list[int] = []
    errors: list[BaseException] = []
    go = threading.Barrier(2)

    def host():
        try:
            go.wait()
            counts.append(archive.archive(older_than_days=WINDOW, batch=3).jobs)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=host) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(counts) == len(finished) == ArchivedJob.objects.count()
    assert not Job.objects.exists() and not Effect.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_archive__a_finished_follow_up_forgets_its_archived_parent():
    """What points at an archived job is let go in the same transaction, and the commit
    (where the database checks its foreign keys) goes through."""
    parent = _finished(subject=1)
    child = _finished(subject=2, days_ago=1)  # recent: stays
    Job.objects.filter(pk=child.pk).update(parent=parent)
    assert archive.archive(older_than_days=WINDOW).jobs == 1
    child.refresh_from_db()
    assert child.parent_id is None and not Job.objects.filter(pk=parent.pk).exists()
