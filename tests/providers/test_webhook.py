"""The webhook provider against the real stand-in on loopback, through the real ledger.

Every send goes over HTTP to ``jobs.testing.fakeprovider``; what the provider applied is
read from its own record, never from the ledger under test.
"""

from __future__ import annotations

import json
from datetime import timedelta

import httpx
import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from jobs.delivery import publish
from jobs.engine import effect_machine
from jobs.models import Effect, EffectEvent
from jobs.providers import ProviderNotConfigured
from jobs.providers.webhook import BODY_FIELDS, WebhookProvider
from jobs.registry import EffectSpec
from jobs.tasks import release_effect
from tests.jobs.helpers import deliver as run_delivery
from tests.jobs.helpers import releasable_effects
from tests.providers.conftest import notify_job, wait_for

pytestmark = pytest.mark.django_db

State = Effect.State


def make_due(effect: Effect) -> None:
    """Skip the backoff wait (the wait itself is asserted where it matters)."""
    Effect.objects.filter(pk=effect.pk).update(
        next_attempt_at=timezone.now() - timedelta(seconds=1)
    )


def effect_of(job) -> Effect:
    return Effect.objects.select_related("job").get(job=job)


def test_webhook__accepted_then_timeout_without_lookup_is_resent_with_the_same_key(
    make_user, webhook, settings
):
    """A receiver without the lookup (tests/providers/test_lookup.py: with it): the
    unknown outcome is settled by a resend under the same key, which it replays."""
    settings.NOTICE_PROVIDER_LOOKUP = False
    webhook.faults.stall = 1.0  # every new send is applied, then left unanswered
    user = make_user()
    job = notify_job(user)

    result = run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert result.effects == {effect.effect_id: "pending"}, "published; a sender claims it"
    assert effect.state == State.UNKNOWN
    assert (effect.last_error_class, effect.last_error_code) == ("provider_timeout", "readtimeout")
    assert effect.next_attempt_at > timezone.now(), "backs off before asking again"
    assert len(webhook.record.sends()) == 1, "the provider applied it although we heard nothing"

    make_due(effect)
    assert release_effect(effect.pk) == "applied"
    effect.refresh_from_db()
    (send,) = webhook.record.sends()
    assert effect.state == State.APPLIED and effect.provider_ref == send["send_id"]
    assert effect.attempts == 2
    seen = wait_for(
        lambda: len(webhook.record.requests()) == 2 and webhook.record.requests(),
        what="both calls in the provider's record",
    )
    assert [(r["idempotency_key"], r["outcome"]) for r in seen] == [
        (effect.idempotency_key, "applied_stalled"),
        (effect.idempotency_key, "replay"),
    ]
    assert webhook.record.duplicate_effects() == {}


def test_webhook__an_existing_effect_never_gets_a_new_key(make_user, webhook):
    user = make_user()
    job = notify_job(user)
    webhook.faults.unavailable = 1.0
    webhook.faults.retry_after = 0
    run_delivery(job.pk, worker="w1")  # 503: pending, retried later
    effect = effect_of(job)
    key = effect.idempotency_key
    assert key == effect_machine.idempotency_key(effect.effect_id), "derived from the identity"

    webhook.faults.unavailable = 0.0
    webhook.faults.stall = 1.0
    make_due(effect)
    assert release_effect(effect.pk) == "unknown"  # applied, no answer

    # A sender takes the effect and dies mid-send: its lease expires and the effect is
    # due on the ledger again for another sender.
    webhook.faults.stall = 0.0
    effect.refresh_from_db()
    make_due(effect)
    effect.refresh_from_db()
    assert effect_machine.claim_send(effect, "crashed-sender") == "claimed"
    Effect.objects.filter(pk=effect.pk).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    assert releasable_effects(job=job) == [effect.pk]
    assert release_effect(effect.pk) == "applied"

    # Publishing the same outcome again cannot mint a second row (or key).
    with pytest.raises(IntegrityError), transaction.atomic():
        spec = EffectSpec("completion-notice", "webhook", str(user.pk))
        Effect.objects.bulk_create(publish.prepare(job, [spec], refused={}))

    effect.refresh_from_db()
    assert effect.idempotency_key == key and Effect.objects.filter(job=job).count() == 1
    requests = wait_for(
        lambda: len(webhook.record.requests()) == 2 and webhook.record.requests(),
        what="two sends in the provider's record",
    )
    assert {r["idempotency_key"] for r in requests} == {key}
    assert [r["status"] for r in requests] == [503, 201]
    # The next sender of the dead sender's effect asked first, found it, and sent nothing.
    assert [(r["idempotency_key"], r["status"]) for r in webhook.record.lookups()] == [(key, 200)]
    assert len(webhook.record.sends()) == 1


def test_webhook__422_fails_once_and_is_never_retried(make_user, webhook):
    webhook.faults.reject = 1.0
    webhook.faults.reject_status = 422
    user = make_user()
    job = notify_job(user)

    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.FAILED and effect.attempts == 1
    assert (effect.last_error_class, effect.last_error_code) == ("validation", "http_422")
    assert "invalid" in effect.reason
    assert releasable_effects() == [], "a permanent failure is never released again"
    assert release_effect(effect.pk) == "skipped"
    assert [r["status"] for r in webhook.record.requests()] == [422]
    assert webhook.record.sends() == []


def test_webhook__401_is_withheld_until_an_operator_rechecks(make_user, webhook, settings):
    settings.NOTICE_PROVIDER_TOKEN = "a-revoked-token"
    user = make_user()
    job = notify_job(user)

    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.WITHHELD and effect.attempts == 1
    assert (effect.last_error_class, effect.last_error_code) == ("authorization", "http_401")
    assert "credentials" in effect.reason
    assert releasable_effects() == []
    assert [r["status"] for r in webhook.record.requests()] == [401]
    assert webhook.record.sends() == []


def test_webhook__503_with_retry_after_waits_at_least_that_long(make_user, webhook):
    webhook.faults.unavailable = 1.0
    webhook.faults.retry_after = 30
    user = make_user()
    job = notify_job(user)

    before = timezone.now()
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.PENDING
    assert (effect.last_error_class, effect.last_error_code) == ("temporary", "http_503")
    assert effect.next_attempt_at >= before + timedelta(seconds=30)
    assert releasable_effects() == [], "not due before Retry-After"
    assert release_effect(effect.pk) == "skipped"
    assert len(webhook.record.requests()) == 1


def test_webhook__revoked_recipient_is_withheld_and_the_provider_sees_nothing(
    make_user, webhook, django_user_model
):
    user = make_user()
    job = notify_job(user)

    def revoke(stage, ctx):
        if stage == "published":
            django_user_model.objects.filter(pk=user.pk).update(is_active=False)

    run_delivery(job.pk, worker="w1", on_stage=revoke)
    effect = effect_of(job)
    assert effect.state == State.WITHHELD and "inactive" in effect.reason
    assert effect.last_error_class == "authorization"
    assert webhook.record.requests() == [], "not a single call reached the provider"
    assert list(EffectEvent.objects.values_list("action", "outcome")) == [
        ("claim", "sending"),
        ("withhold", "withheld"),
    ]


def test_webhook__recipient_revoked_between_attempts_is_withheld_before_the_resend(
    make_user, webhook, django_user_model
):
    webhook.faults.unavailable = 1.0
    webhook.faults.retry_after = 0
    user = make_user()
    job = notify_job(user)
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.PENDING

    django_user_model.objects.filter(pk=user.pk).update(is_active=False)
    webhook.faults.unavailable = 0.0
    make_due(effect)
    assert release_effect(effect.pk) == "withheld"
    assert [r["status"] for r in webhook.record.requests()] == [503]
    assert webhook.record.sends() == []


def test_webhook__key_reused_with_another_body_is_409_and_fails(make_user, webhook):
    user = make_user()
    job = notify_job(user)
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.APPLIED

    # A damaged row: the same identity and key, but a different body. The
    # provider refuses it instead of applying a second notice.
    Effect.objects.filter(pk=effect.pk).update(
        state=State.PENDING,
        data={"report_key": "job-0-rev-0"},
        next_attempt_at=timezone.now() - timedelta(seconds=1),  # due by SQLite's ms clock too
    )
    assert release_effect(effect.pk) == "failed"
    effect.refresh_from_db()
    assert effect.last_error_code == "http_409" and "different body" in effect.reason
    assert [r["status"] for r in webhook.record.requests()] == [201, 409]
    assert len(webhook.record.sends()) == 1


def test_webhook__refused_connection_is_transport_and_backs_off(make_user, webhook):
    webhook.set_down(True)
    wait_for(lambda: not webhook.listening, what="the port to close")
    user = make_user()
    job = notify_job(user)

    before = timezone.now()
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.PENDING
    assert effect.last_error_class == "transport" and effect.last_error_code == "connecterror"
    assert effect.next_attempt_at >= before + timedelta(seconds=0.2), "floor: never immediate"

    webhook.set_down(False)
    wait_for(lambda: webhook.listening, what="the port to open")
    make_due(effect)
    assert release_effect(effect.pk) == "applied"
    assert [r["status"] for r in webhook.record.requests()] == [201]


def test_webhook__body_is_the_six_references_with_key_and_bearer_token(make_user, webhook):
    user = make_user()
    job = notify_job(user)
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.APPLIED
    (send,) = webhook.record.sends()
    body = json.loads(send["body"])
    assert tuple(sorted(body)) == tuple(sorted(BODY_FIELDS))
    assert body == {
        "effect_id": effect.effect_id,
        "recipient": str(user.pk),
        "job": job.pk,
        "revision": 1,
        "report_key": f"job-{job.uid}-rev-1",
        "kind": "completion-notice",
    }
    assert "Jane" not in send["body"] and "555" not in send["body"], "no private data"
    assert send["idempotency_key"] == effect.idempotency_key
    assert webhook.record.requests()[0]["status"] == 201, "the bearer token was accepted"


def test_webhook__missing_url_fails_naming_the_setting(make_user, webhook, settings):
    del settings.NOTICE_PROVIDER_URL
    user = make_user()
    job = notify_job(user)
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.NEEDS_REVIEW
    assert "NOTICE_PROVIDER_URL" in effect.reason
    assert effect.last_error_code == "provider_not_configured"
    with pytest.raises(ProviderNotConfigured, match="NOTICE_PROVIDER_URL is not set"):
        WebhookProvider().send(effect)
    assert webhook.record.requests() == []


def test_webhook__separate_connect_and_read_timeouts_from_settings(settings):
    settings.NOTICE_PROVIDER_CONNECT_TIMEOUT = 1.5
    settings.NOTICE_PROVIDER_READ_TIMEOUT = 7
    timeout = WebhookProvider().timeout()
    assert isinstance(timeout, httpx.Timeout)
    assert (timeout.connect, timeout.read) == (1.5, 7.0)


def test_webhook__a_link_in_the_effect_data_reaches_the_body_and_free_text_does_not(
    make_user, webhook
):
    from jobs.models import Effect
    from jobs.providers.webhook import notice_body

    user = make_user()
    job = notify_job(user)
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    Effect.objects.filter(pk=effect.pk).update(data={**effect.data, "link": "/permits/42/report/"})
    effect.refresh_from_db()
    body = notice_body(effect)
    assert body["link"] == "/permits/42/report/"
    assert set(body) == {*BODY_FIELDS, "link"}
    assert "Jane" not in json.dumps(body), "title (free text) is not sent"
