"""The effect path with real qcluster workers, the dispatcher and the stand-in provider."""

from __future__ import annotations

import time

from django.contrib.auth.models import User
from django.urls import reverse
from django_q.models import OrmQ

from jobs.delivery import publish
from jobs.models import Effect, EffectEvent, Job
from jobs.registry import EffectSpec
from tests.e2e.processes import PROVIDER_TOKEN, wait_until
from tests.jobs.helpers import request_job

State = Effect.State


def _with_provider(procs, provider, **extra: str) -> None:
    procs.env.update(
        NOTICE_PROVIDER_URL=provider.url,
        NOTICE_PROVIDER_TOKEN=PROVIDER_TOKEN,
        NOTICE_PROVIDER_CONNECT_TIMEOUT="0.5",
        NOTICE_PROVIDER_READ_TIMEOUT="0.5",
        JOBS_EFFECT_LEASE_SECONDS="4",
        **extra,
    )


def missing_event_versions(effect: Effect) -> list[int]:
    seen = set(effect.events.values_list("version", flat=True))
    return [v for v in range(1, effect.version + 1) if v not in seen]


def test_release_check_raising__ends_at_the_budget_in_needs_review_under_real_workers(
    procs, provider
):
    """A kind whose release check always raises: each effect stops at its budget, unsent."""
    _with_provider(procs, provider, JOBS_EFFECT_MAX_ATTEMPTS="4")
    user = User.objects.create_user(username="e2e-budget")
    job, _ = request_job(
        "test.release_check_raises",
        subject_type="auth.user",
        subject_id=user.pk,
        params={"recipient": user.pk, "providers": ["inapp", "webhook"]},
    )
    procs.start("qcluster", "qcluster")
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.2")
    wait_until(
        procs,
        "both effects to stop",
        lambda: (
            Effect.objects.filter(job=job).count() == 2
            and not Effect.objects.filter(job=job).exclude(state=State.NEEDS_REVIEW).exists()
        ),
        timeout=90,
    )
    time.sleep(1.5)  # the dispatcher keeps running: nothing may move any more
    assert Job.objects.get(pk=job.pk).state == Job.State.SUCCEEDED
    for effect in Effect.objects.filter(job=job):
        assert effect.state == State.NEEDS_REVIEW and effect.attempts == effect.max_attempts == 4
        assert "exhausted" in effect.reason
        assert missing_event_versions(effect) == [], "every arrow has its event"
        assert not effect.events.filter(action=EffectEvent.Action.SEND).exists()
    assert provider.record.requests() == [], "the provider saw no call (budget: 4)"
    assert not [m for m in OrmQ.objects.all() if m.func() == "jobs.tasks.release_effect"]


def test_admin_send_again_on_20_effects__returns_at_once_and_a_worker_sends(
    procs, provider, client
):
    _with_provider(procs, provider)
    operator = User.objects.create_superuser("opsalice", password="pw-ops-alice-0123")
    reviewer = User.objects.create_user(username="e2e-reviewer")
    effects = []
    for n in range(20):
        job, _ = request_job(
            "test.notify_only",
            subject_type="auth.user",
            subject_id=str(n),
            params={"recipient": reviewer.pk, "providers": ["webhook"]},
        )
        Job.objects.filter(pk=job.pk).update(state=Job.State.SUCCEEDED)
        (spec,) = [EffectSpec("notice-webhook", "webhook", str(reviewer.pk), {})]
        (effect,) = Effect.objects.bulk_create(publish.prepare(job, [spec], refused={}))
        effects.append(effect)
    Effect.objects.update(state=State.NEEDS_REVIEW, reason="stopped for the test")
    assert not OrmQ.objects.exists()

    client.force_login(operator)
    started = time.monotonic()
    answer = client.post(
        reverse("admin:jobs_effect_changelist"),
        # confirmed: the list action's confirmation page is answered (issue 21)
        {"action": "send_again", "_selected_action": [e.pk for e in effects], "confirmed": "yes"},
    )
    elapsed = time.monotonic() - started
    print(f"admin send again on 20 effects answered in {elapsed * 1000:.0f} ms")
    assert answer.status_code == 302
    assert provider.record.requests() == [], "the web request sent nothing itself"
    assert Effect.objects.filter(state=State.PENDING).count() == 20
    # The ledger's rows are the queue: no message for a release.
    assert not OrmQ.objects.exists()

    procs.start("qcluster", "qcluster")
    wait_until(
        procs,
        "20 effects applied by the worker",
        lambda: Effect.objects.filter(state=State.APPLIED).count() == 20,
        timeout=60,
    )
    assert len(provider.record.sends()) == 20 and provider.record.duplicate_effects() == {}
    for effect in Effect.objects.all():
        actions = list(effect.events.order_by("id").values_list("action", "actor"))
        assert ("send_again", "operator:opsalice") in actions
        (send,) = [actor for action, actor in actions if action == "send"]
        assert not send.startswith("operator:"), "a worker sent it, not the web request"
