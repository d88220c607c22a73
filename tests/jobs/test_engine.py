"""One outcome per job through the real runner, ledger and storage (any database)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from io import StringIO
from pathlib import Path
from unittest import mock

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django_q.models import OrmQ

from jobs import artifacts, claiming, conf, registry, rules, services
from jobs.delivery import runner
from jobs.delivery.runner import run_delivery
from jobs.engine import effect_machine, job_machine
from jobs.executors import postgres
from jobs.models import Artifact, Attempt, Effect, Job, Notice
from jobs.tasks import release_effect
from tests.jobs.helpers import (
    Crash,
    claim_next,
    expire_lease,
    make_due,
    new_job,
    run_queued_effects,
)

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]


def outcomes(job):
    return list(Attempt.objects.filter(job=job).order_by("id").values_list("outcome", flat=True))


def test_request_job__same_subject_and_revision_is_the_same_job(make_user):
    user = make_user()
    first = new_job(user)
    again = new_job(user)
    other_revision = new_job(user, revision=2)
    assert first.pk == again.pk != other_revision.pk
    assert Job.objects.count() == 2, "one row per job, not per request"
    assert not OrmQ.objects.exists(), "the jobs table is the queue: no django_q_ormq row"


def test_request_job__no_queue_message_and_the_wakeup_carries_nothing_private(make_user):
    user = make_user()
    with CaptureQueriesContext(connection) as asked:
        job = new_job(user, note="private-marker-123")
    assert Job.objects.get(pk=job.pk).params["note"] == "private-marker-123"
    assert not OrmQ.objects.exists()
    queue_statements = [
        q["sql"]
        for q in asked.captured_queries
        if "pg_notify" in q["sql"] or "django_q" in q["sql"]
    ]
    assert not [sql for sql in queue_statements if "private-marker-123" in sql]


def test_run_delivery__one_artifact_one_effect_one_notice(make_user):
    user = make_user()
    job = new_job(user)
    result = run_delivery(job.pk, worker="w1")
    assert result.outcome == "succeeded"
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED and job.attempts == 1
    artifact = Artifact.objects.get(job=job)
    assert artifact.key == f"job-{job.uid}-rev-1" and artifacts.is_intact(artifact)
    effect = Effect.objects.get(job=job)
    assert effect.effect_id == f"{job.uid}:1:completion-notice:{user.pk}"
    assert effect.idempotency_key == effect_machine.idempotency_key(effect.effect_id)
    assert effect.state == Effect.State.APPLIED
    assert Notice.objects.filter(recipient=user).count() == 1

    assert run_delivery(job.pk, worker="w2").outcome == "duplicate"
    assert outcomes(job) == ["succeeded", "duplicate_delivery"]
    assert (Artifact.objects.count(), Effect.objects.count(), Notice.objects.count()) == (1, 1, 1)


def test_run_delivery__malformed_payload_fails_once_with_a_readable_reason(make_user):
    user = make_user()
    job = new_job(user)
    Job.objects.filter(pk=job.pk).update(params={"recipients": "not-a-list"})
    assert run_delivery(job.pk, worker="w1").outcome == "failed"
    job.refresh_from_db()
    assert job.state == Job.State.FAILED and job.attempts == 1
    assert (job.last_error_class, job.last_error_code) == ("validation", "payload_invalid")
    assert "params.recipients must be a list" in job.last_error_detail
    assert claim_next() is None, "a permanent failure is never claimed again"
    assert run_delivery(job.pk, worker="w2").outcome == "duplicate"
    assert Job.objects.get(pk=job.pk).attempts == 1


def test_run_delivery__transient_error_backs_off_then_dies_at_max_attempts(make_user):
    user = make_user()
    job = new_job(user, fail={"always": "temporary"})
    for _ in range(job.max_attempts):
        make_due(job)
        run_delivery(job.pk, worker="w")
    job.refresh_from_db()
    assert job.state == Job.State.DEAD and job.attempts == job.max_attempts == 5
    assert (job.last_error_class, job.last_error_code) == ("temporary", "test_unavailable")
    delays = list(
        Attempt.objects.filter(job=job, outcome="retry").values_list(
            "retry_delay_seconds", flat=True
        )
    )
    assert len(delays) == 4 and all(d >= 0.2 for d in delays), "floor: never immediate"
    for n, delay in enumerate(delays, start=1):  # floor + jitter within a doubling window
        assert delay <= 0.2 + min(2.0, 0.2 * 2 ** (n - 1))
    assert outcomes(job)[-1] == "dead"
    make_due(job)
    assert run_delivery(job.pk, worker="w").outcome == "duplicate", "nothing retries forever"
    assert Job.objects.get(pk=job.pk).attempts == 5


def test_run_delivery__retry_succeeds_and_verifies_instead_of_rewriting(make_user):
    user = make_user()
    job = new_job(user, fail={"1": "unknown"})
    assert run_delivery(job.pk, worker="w1").outcome == "retry"
    job.refresh_from_db()
    assert job.state == Job.State.RETRY_WAIT and job.last_error_class == "unknown"
    make_due(job)
    assert run_delivery(job.pk, worker="w2").outcome == "succeeded"
    assert Artifact.objects.filter(job=job).count() == 1


def test_crash_after_artifact__reclaim_leaves_a_torn_file_alone_and_writes_its_own(make_user):
    user = make_user()
    job = new_job(user)
    left = {}

    def die_after_artifact(stage, ctx):
        if stage == "artifact_stored":
            left["name"] = ctx.artifact.storage_name
            raise Crash

    with pytest.raises(Crash):
        run_delivery(job.pk, worker="w1", on_stage=die_after_artifact)
    assert not Artifact.objects.filter(job=job).exists(), "the row commits with the publish"
    path = Path(artifacts.get_storage().path(left["name"]))
    path.write_bytes(b"torn write")

    assert run_delivery(job.pk, worker="w2").outcome == "duplicate", "lease still live"
    expire_lease(job)
    assert run_delivery(job.pk, worker="w2").outcome == "succeeded"
    assert outcomes(job) == ["crashed", "duplicate_delivery", "succeeded"]
    artifact = Artifact.objects.get(job=job)
    assert artifact.rewrites == 0 and artifacts.is_intact(artifact)
    assert artifact.storage_name != left["name"], "the torn file is never overwritten"
    assert artifact.storage_name.startswith(left["name"].removesuffix(".txt") + "-")
    assert path.read_bytes() == b"torn write", "left for jobs_prune, not rewritten"
    assert (Artifact.objects.count(), Effect.objects.count(), Notice.objects.count()) == (1, 1, 1)


def test_crash_after_publish_before_ack__the_in_app_notice_committed_with_publish(make_user):
    user = make_user()
    job = new_job(user)

    def die_after_publish(stage, ctx):
        if stage == "published":
            raise Crash

    with pytest.raises(Crash):
        run_delivery(job.pk, worker="w1", on_stage=die_after_publish)
    assert Job.objects.get(pk=job.pk).state == Job.State.SUCCEEDED
    effect = Effect.objects.get(job=job)
    assert effect.state == Effect.State.APPLIED and Notice.objects.count() == 1
    assert effect.provider_ref == f"notice:{Notice.objects.get().pk}"

    assert run_delivery(job.pk, worker="w2").outcome == "duplicate"
    assert claiming.claims().claim_effect("w9") is None, "nothing left to release"
    assert release_effect(effect.pk) == "skipped"
    assert Notice.objects.count() == 1


def test_published_effect_left_pending__is_due_on_the_ledger_and_sent_once(make_user, monkeypatch):
    """A notice that could not be built at publish goes pending, due on its ledger row.

    Building the in-app notice (``notice_for``, in the publish plan) fails here: the
    retry table decides, as for a failed apply, and the job still publishes.
    """
    user = make_user()
    job = new_job(user)
    inapp = registry.get_provider("inapp")

    def flaky_notice(effect):
        raise ConnectionResetError("notice store unavailable")

    monkeypatch.setattr(inapp, "notice_for", flaky_notice)
    run_delivery(job.pk, worker="w1")
    monkeypatch.undo()
    effect = Effect.objects.get(job=job)
    assert effect.state == Effect.State.PENDING and Notice.objects.count() == 0
    assert Job.objects.get(pk=job.pk).state == Job.State.SUCCEEDED
    assert list(effect.events.values_list("action", "outcome", "version")) == [
        ("send", "pending", 1)
    ], "the failed apply is recorded"
    assert not OrmQ.objects.exists(), "no message: the ledger row is its queue entry"
    releasable = Effect.objects.filter(rules.to_q(rules.EFFECT_RELEASABLE))
    assert list(releasable.values_list("pk", flat=True)) == [effect.pk]
    assert release_effect(effect.pk) == "applied"
    assert release_effect(effect.pk) == "skipped"
    assert Notice.objects.count() == 1


def test_poison_message__crashes_count_toward_max_attempts(make_user):
    user = make_user()
    job = new_job(user, kind="test.short")

    def die(stage, ctx):
        raise Crash

    for _ in range(3):
        with pytest.raises(Crash):
            run_delivery(job.pk, worker="w", on_stage=die)
        expire_lease(job)
    assert run_delivery(job.pk, worker="w").outcome == "buried"
    job.refresh_from_db()
    assert job.state == Job.State.DEAD and job.attempts == 3
    assert job.last_error_code == "crashed"
    assert outcomes(job) == ["crashed", "crashed", "crashed", "dead"]


def test_revoked_recipient__effect_withheld_then_released_once_after_regrant(make_user):
    user = make_user()
    job = new_job(user)

    def revoke(stage, ctx):
        if stage == "before_publish":  # still running: recipients chosen, nothing released
            type(user).objects.filter(pk=user.pk).update(is_active=False)

    run_delivery(job.pk, worker="w", on_stage=revoke)
    effect = Effect.objects.get(job=job)
    assert effect.state == Effect.State.WITHHELD and "inactive" in effect.reason
    assert Notice.objects.count() == 0
    type(user).objects.filter(pk=user.pk).update(is_active=True)
    assert services.recheck_and_release(effect, operator="op1")
    assert services.recheck_and_release(Effect.objects.get(pk=effect.pk), operator="op1") is False
    assert Effect.objects.get(pk=effect.pk).state == Effect.State.PENDING, "a worker sends"
    assert run_queued_effects() == {effect.pk: "applied"}
    assert Effect.objects.get(pk=effect.pk).state == Effect.State.APPLIED
    assert Notice.objects.count() == 1


def test_retry__a_due_retry_is_claimable_once_at_its_due_time(make_user):
    user = make_user()
    job = new_job(user, fail={"1": "temporary"})
    assert run_delivery(job.pk, worker="w").outcome == "retry"
    assert Job.objects.get(pk=job.pk).state == Job.State.RETRY_WAIT
    assert claim_next(worker="w2") is None, "not due yet"
    make_due(job)
    claim = claim_next(worker="w2")
    assert claim.won and claim.job.pk == job.pk and claim.job.attempts == 2
    assert claim_next(worker="w3") is None, "claimed once"
    assert not OrmQ.objects.exists()
    assert runner.run_claim(claim, "w2").outcome == "succeeded"


def test_expired_lease__its_job_is_claimed_again_once(make_user):
    user = make_user()
    job = new_job(user)
    with pytest.raises(Crash):
        run_delivery(job.pk, worker="w1", on_stage=lambda stage, ctx: (_ for _ in ()).throw(Crash))
    claims, lease, bound = claiming.claims(), conf.lease_seconds(), conf.tenant_concurrency()
    assert claims.decide_own_verdict("default", "w2", lease=lease, bound=bound) is None
    expire_lease(job)
    claim = claims.decide_own_verdict("default", "w2", lease=lease, bound=bound)
    assert claim.won and claim.job.pk == job.pk and claim.job.lease_owner == "w2"
    assert claims.decide_own_verdict("default", "w3", lease=lease, bound=bound) is None
    assert claim_next(worker="w3") is None, "held by w2 now"
    assert not OrmQ.objects.exists()
    assert runner.run_claim(claim, "w2").outcome == "succeeded"


def test_tenant_bound__delivery_over_the_bound_is_deferred_without_spending_an_attempt(
    make_user, settings
):
    settings.JOBS_TENANT_CONCURRENCY = 1
    user = make_user()
    first = new_job(user, subject=1)
    second = new_job(user, subject=2)
    held = {}

    def hold(stage, ctx):
        if stage == "claimed" and "second" not in held:
            held["second"] = run_delivery(second.pk, worker="w2")

    assert run_delivery(first.pk, worker="w1", on_stage=hold).outcome == "succeeded"
    assert held["second"].outcome == "deferred"
    second.refresh_from_db()
    assert second.state == Job.State.QUEUED and second.attempts == 0
    assert not OrmQ.objects.exists(), "its row's due time is all it needs"
    make_due(second)
    assert run_delivery(second.pk, worker="w2").outcome == "succeeded"


def test_operator_actions_go_through_transitions(make_user):
    user = make_user()
    job = new_job(user, fail={"always": "validation"})
    assert services.cancel_job(Job.objects.get(pk=job.pk))
    assert run_delivery(job.pk, worker="w").outcome == "duplicate"

    other = new_job(user, revision=2, fail={"1": "validation"})
    run_delivery(other.pk, worker="w")
    other.refresh_from_db()
    assert other.state == Job.State.FAILED
    Job.objects.filter(pk=other.pk).update(params={"recipients": [user.pk]})  # data fixed
    other.refresh_from_db()
    assert services.requeue_job(other)
    other.refresh_from_db()
    # A fresh budget on top of the attempts made: attempt numbers never repeat.
    assert other.state == Job.State.QUEUED and other.attempts == 1
    assert other.max_attempts > other.attempts
    assert run_delivery(other.pk, worker="w").outcome == "succeeded"
    numbers = list(other.attempt_set.exclude(number=0).values_list("number", flat=True))
    assert numbers == [1, 2]
    history = list(other.events.values_list("action", "from_state", "to_state"))
    assert history == [("requeue", "failed", "queued")]


def test_jobs_stats__json_counts_deliveries_and_effects_apart(make_user):
    user = make_user()
    job = new_job(user)
    run_delivery(job.pk, worker="w1")
    run_delivery(job.pk, worker="w2")
    out = StringIO()
    call_command("jobs_stats", "--json", stdout=out)
    stats = json.loads(out.getvalue())
    assert stats["jobs"]["by_state"] == {"succeeded": 1}
    assert stats["deliveries"] == 2 and stats["duplicate_deliveries"] == 1
    assert stats["effects"]["by_state"] == {"applied": 1}
    assert stats["duplicate_effects"] == 0


def test_settings__production_without_secret_key_names_the_setting():
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DJANGO_SETTINGS_MODULE")}
    env.update(DEBUG="0", ALLOWED_HOSTS="example.org")
    proc = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "SECRET_KEY must be set" in proc.stderr


def test_dispatch_schedule__installed_by_migrate():
    from django_q.models import Schedule

    schedule = Schedule.objects.get(name="jobs.dispatch")
    assert (schedule.func, schedule.schedule_type, schedule.repeats) == (
        "jobs.tasks.run_dispatcher",
        Schedule.MINUTES,
        -1,
    )


def test_expired_lease__worker_can_neither_heartbeat_nor_publish_even_unreclaimed(make_user):
    """Invariant 3: a worker whose lease expired publishes nothing, reclaimed or not."""

    job = new_job(make_user())
    claim = runner.claim_for(job.pk, "late-worker")
    assert claim.won
    expire_lease(job)
    late = claim.job
    assert job_machine.still_owner(late, "late-worker") is False
    assert job_machine.heartbeat(late, "late-worker") is False
    assert job_machine.publish(late, "late-worker") is False
    assert Job.objects.get(pk=job.pk).state == Job.State.RUNNING, "left for a reclaim"
    assert run_delivery(job.pk, worker="next-worker").outcome == "succeeded"


@pytest.mark.postgres
@pytest.mark.parametrize("change", ["deactivate", "delete"])
def test_one_statement_publish__refused_for_a_changed_account__each_recipient_decided(
    make_user, change, caplog
):
    """The publish statement finds one of two recipients gone or inactive: it writes
    nothing, and the plan is built again with the refused one withheld (one notice,
    one withheld)."""
    keep, lose = make_user(), make_user()
    job = new_job(keep)
    Job.objects.filter(pk=job.pk).update(params={"recipients": [keep.pk, lose.pk]})
    calls = []
    real_publish = postgres._publish_in_one

    def change_account_then_publish(*args, **kwargs):
        if not calls:  # between the handler and the publish statement
            users = type(lose).objects.filter(pk=lose.pk)
            users.update(is_active=False) if change == "deactivate" else users.delete()
        (plan,) = args
        calls.append(list(plan.accounts))
        return real_publish(*args, **kwargs)

    with (
        caplog.at_level("INFO", logger="jobs.runner"),
        mock.patch.object(postgres, "_publish_in_one", change_account_then_publish),
    ):
        assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    assert calls[0] == [str(keep.pk), str(lose.pk)], "the statement checked both accounts"
    assert "a recipient's account changed" in caplog.text
    states = dict(Effect.objects.filter(job=job).values_list("recipient", "state"))
    assert states == {str(keep.pk): "applied", str(lose.pk): "withheld"}
    assert list(Notice.objects.values_list("recipient_id", flat=True)) == [keep.pk]
    assert Artifact.objects.filter(job=job).count() == 1
    assert outcomes(job) == ["succeeded"]
