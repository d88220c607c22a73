"""Reconcile by key (issue 43): an unknown outcome is looked up before any new send.

The webhook provider asks the stand-in ``GET /notices/{key}`` on loopback; the stand-in
records lookups apart from sends, so each test counts the POSTs the provider really got
for the effect's key. Today's rule (resend under the same key) is kept for a provider
without the lookup: tests/providers/test_webhook.py.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from jobs.delivery import release
from jobs.engine import effect_machine
from jobs.models import Effect, EffectEvent
from jobs.providers import ProviderLookupUnsupported
from jobs.providers.webhook import WebhookProvider
from jobs.stats import collect_providers
from jobs.tasks import release_effect
from tests.jobs.helpers import deliver as run_delivery
from tests.providers.conftest import notify_job, wait_for

pytestmark = pytest.mark.django_db

State = Effect.State
Action = EffectEvent.Action


def make_due(effect: Effect) -> None:
    Effect.objects.filter(pk=effect.pk).update(
        next_attempt_at=timezone.now() - timedelta(seconds=1)
    )


def stalled_effect(user, webhook, *, due: bool = True) -> Effect:
    """A notice the provider applied and never answered: ``unknown`` in the ledger (and
    due now, unless ``due`` is False: a later delivery would follow on to it)."""
    webhook.faults.stall = 1.0
    job = notify_job(user)
    run_delivery(job.pk, worker="w1")
    webhook.faults.stall = 0.0
    effect = Effect.objects.select_related("job").get(job=job)
    applied = [s["effect_id"] for s in webhook.record.sends()]
    assert effect.state == State.UNKNOWN and applied.count(effect.effect_id) == 1
    if due:
        make_due(effect)
    return effect


# The stand-in files a stalled send (applied, never answered) under the status it would
# have answered.
STALLED = 201


def posts(webhook, effect: Effect) -> list[int]:
    return [r["status"] for r in webhook.record.requests_for(effect.idempotency_key)]


def lookups(webhook, effect: Effect) -> list[int]:
    return [r["status"] for r in webhook.record.lookups_for(effect.idempotency_key)]


def test_lookup__accepted_then_timeout_is_found_by_key_with_no_second_send(
    make_user, webhook, caplog
):
    effect = stalled_effect(make_user(), webhook)
    caplog.set_level(logging.INFO)

    assert release_effect(effect.pk) == State.APPLIED
    effect.refresh_from_db()
    (send,) = webhook.record.sends()
    assert effect.provider_ref == send["send_id"], "the provider's reference, from the lookup"
    assert posts(webhook, effect) == [STALLED], "one POST (applied, never answered): no second send"
    assert lookups(webhook, effect) == [200]
    last = effect.events.order_by("id").last()
    assert (last.action, last.outcome, last.error_code) == (Action.LOOKUP, State.APPLIED, "found")
    figures = collect_providers()["webhook"]
    assert (figures["sends"], figures["resends"], figures["duplicate_effects"]) == (1, 0, 0)
    assert effect.idempotency_key not in caplog.text, "a log line carries the key"


def test_lookup__a_sender_lost_before_its_call_landed_gets_404_and_sends_once(make_user, webhook):
    webhook.faults.unavailable, webhook.faults.retry_after = 1.0, 0
    job = notify_job(make_user())
    run_delivery(job.pk, worker="w1")  # 503: pending, nothing landed
    webhook.faults.unavailable = 0.0
    effect = Effect.objects.select_related("job").get(job=job)
    make_due(effect)
    effect.refresh_from_db()
    # A sender takes it and dies before its request reached the provider.
    assert effect_machine.claim_send(effect, "lost-sender") == "claimed"
    Effect.objects.filter(pk=effect.pk).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )

    assert release_effect(effect.pk) == State.APPLIED
    assert lookups(webhook, effect) == [404], "asked first: the provider never saw the key"
    assert posts(webhook, effect) == [503, 201], "then sent, once"
    actions = list(effect.events.order_by("id").values_list("action", "outcome"))
    assert (Action.LOOKUP, "not_found") in actions and actions[-1] == (Action.SEND, "applied")


@pytest.mark.parametrize("failure", ["unavailable", "down"])
def test_lookup__that_fails_leaves_the_effect_unknown_and_sends_nothing(
    make_user, webhook, failure
):
    effect = stalled_effect(make_user(), webhook)
    if failure == "unavailable":
        webhook.faults.lookup_unavailable, webhook.faults.retry_after = 1.0, 0
    else:
        webhook.set_down(True)
        wait_for(lambda: not webhook.listening, what="the port to close")

    assert release_effect(effect.pk) == State.UNKNOWN, "the provider said nothing: no send"
    effect.refresh_from_db()
    assert posts(webhook, effect) == [STALLED], "never a blind send"
    assert lookups(webhook, effect) == ([503] if failure == "unavailable" else [])
    assert effect.next_attempt_at > timezone.now(), "asked again later, after a backoff"
    last = effect.events.order_by("id").last()
    assert last.action == Action.LOOKUP and last.outcome == State.UNKNOWN
    assert last.error_class == ("temporary" if failure == "unavailable" else "transport")

    webhook.faults.lookup_unavailable = 0.0
    webhook.set_down(None)
    wait_for(lambda: webhook.listening, what="the port to open")
    make_due(effect)
    assert release_effect(effect.pk) == State.APPLIED
    assert posts(webhook, effect) == [STALLED]
    assert webhook.record.duplicate_effects() == {}


def test_lookup__a_provider_that_answers_405_keeps_todays_rule(make_user, webhook):
    effect = stalled_effect(make_user(), webhook)
    webhook.faults.no_lookup = True  # a receiver without GET /notices/{key}

    assert release_effect(effect.pk) == State.APPLIED
    assert lookups(webhook, effect) == [405]
    assert posts(webhook, effect) == [STALLED, 200], "resent under the same key, replayed"
    assert len(webhook.record.sends()) == 1


def test_lookup__off_by_setting_is_todays_rule_side_by_side(make_user, webhook, settings):
    """The figure the issue asked for: POSTs per key with and without the lookup."""
    with_lookup = stalled_effect(make_user(), webhook)
    release_effect(with_lookup.pk)
    settings.NOTICE_PROVIDER_LOOKUP = False
    without = stalled_effect(make_user(), webhook)
    release_effect(without.pk)
    seen = {
        "with_lookup": {
            "posts": posts(webhook, with_lookup),
            "lookups": lookups(webhook, with_lookup),
        },
        "without": {"posts": posts(webhook, without), "lookups": lookups(webhook, without)},
    }
    print(f"provider requests per key: {seen}")
    assert seen == {
        "with_lookup": {"posts": [STALLED], "lookups": [200]},
        "without": {"posts": [STALLED, 200], "lookups": []},
    }


def test_lookup__the_webhook_call_quotes_the_key_and_never_names_it_in_errors(settings, webhook):
    settings.NOTICE_PROVIDER_READ_TIMEOUT = 0.5
    provider = WebhookProvider()
    assert provider.supports_lookup
    assert provider.lookup("fx-never-sent") is None
    assert webhook.record.lookups()[-1]["idempotency_key"] == "fx-never-sent"

    settings.NOTICE_PROVIDER_TOKEN = "wrong-token"
    with pytest.raises(Exception) as refused:
        provider.lookup("fx-secret-key")
    assert refused.value.error_class == "authorization" and refused.value.code == "http_401"
    assert "fx-secret-key" not in str(refused.value) and refused.value.__cause__ is None

    webhook.faults.no_lookup = True
    settings.NOTICE_PROVIDER_TOKEN = "test-token-0123"
    with pytest.raises(ProviderLookupUnsupported):
        provider.lookup("fx-secret-key")

    settings.NOTICE_PROVIDER_URL = "http://127.0.0.1:9"  # nothing listens: refused
    with pytest.raises(Exception) as unreachable:
        provider.lookup("fx-secret-key")
    assert unreachable.value.error_class == "transport"
    assert "fx-secret-key" not in str(unreachable.value)
    assert not isinstance(unreachable.value, httpx.HTTPError)


def test_lookup__email_has_no_lookup_and_keeps_needs_review():
    from jobs import registry

    assert registry.get_provider("email").supports_lookup is False
    assert registry.get_provider("webhook").supports_lookup is True


def test_lookup__refused_credentials_withhold_as_for_a_send(make_user, webhook):
    """A 401 to the lookup is the authorization row of the table, as a 401 to a send:
    withheld, nothing sent; an operator's re-check sends under the same key."""
    effect = stalled_effect(make_user(), webhook)
    webhook.token = "rotated-on-the-provider"

    assert release_effect(effect.pk) == State.WITHHELD
    effect.refresh_from_db()
    assert (effect.last_error_class, effect.last_error_code) == ("authorization", "http_401")
    assert posts(webhook, effect) == [STALLED] and lookups(webhook, effect) == [401]


def test_lookup__failing_lookups_open_the_circuit_and_wait_unknown_without_a_send(
    make_user, webhook, settings
):
    """Lookups are calls: in a provider outage they count for its circuit like sends, and
    the effects then wait (unknown, no attempt spent) instead of burning their budget."""
    from jobs import flow
    from jobs.models import FlowRule

    flow.forget()
    settings.JOBS_BACKOFF_FLOOR_SECONDS = 60  # the next stalled delivery must not release
    settings.JOBS_CIRCUIT_FAILURES = 100  # the stalled sends count too: not yet
    settings.JOBS_CIRCUIT_PROBE_SECONDS = 30.0
    settings.JOBS_FLOW_CACHE_SECONDS = 0.0
    effects = [stalled_effect(make_user(), webhook, due=False) for _ in range(3)]
    FlowRule.objects.filter(scope="provider:webhook").update(circuit_failures=0)
    settings.JOBS_CIRCUIT_FAILURES = 2
    for e in effects:
        make_due(e)
        e.refresh_from_db()
    assert [e.state for e in effects] == [State.UNKNOWN] * 3
    webhook.faults.lookup_unavailable, webhook.faults.retry_after = 1.0, 0

    # One release each, by hand (a task would follow on to the next due effect itself).
    outcomes = [release.release(e, "w2") for e in effects]
    assert outcomes == [State.UNKNOWN, State.UNKNOWN, "deferred"], "the 2nd opened it"
    rule = FlowRule.objects.get(scope="provider:webhook")
    assert rule.circuit_state == FlowRule.Circuit.OPEN
    for e in effects:
        e.refresh_from_db()
    assert [e.state for e in effects] == [State.UNKNOWN] * 3, "never pending: it may have landed"
    assert [e.attempts for e in effects] == [2, 2, 1], "held at the gate: no attempt spent"
    assert [len(lookups(webhook, e)) for e in effects] == [1, 1, 0], "the 3rd held at the gate"
    assert all(posts(webhook, e) == [STALLED] for e in effects), "no send while nobody knew"

    webhook.faults.lookup_unavailable = 0.0
    FlowRule.objects.filter(pk=rule.pk).update(
        circuit_probe_at=timezone.now() - timedelta(seconds=1)
    )
    for e in effects:
        make_due(e)
        e.refresh_from_db()
        assert release.release(e, "w3") == State.APPLIED
    assert Effect.objects.filter(state=State.APPLIED).count() == 3
    assert all(posts(webhook, e) == [STALLED] for e in effects)
    rule.refresh_from_db()
    assert rule.circuit_state == FlowRule.Circuit.CLOSED, "a found lookup closes the circuit"
    flow.forget()
