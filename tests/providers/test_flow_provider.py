"""Provider flow rules at the effect's slot, and the circuit breaker, through the real ledger
against the stand-in provider (PostgreSQL and SQLite)."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import flow, registry
from jobs.engine import admission
from jobs.models import Effect, EffectEvent, FlowRule, FlowRuleChange
from jobs.tasks import release_effect
from tests.jobs.helpers import deliver as run_delivery
from tests.providers.conftest import notify_job

pytestmark = pytest.mark.django_db

State = Effect.State
Circuit = FlowRule.Circuit


@pytest.fixture(autouse=True)
def _fresh_rules():
    flow.forget()
    yield
    flow.forget()


def probe_time_comes() -> None:
    FlowRule.objects.filter(scope="provider:webhook").update(
        circuit_probe_at=timezone.now() - timedelta(seconds=1)
    )


def make_due(effect: Effect) -> None:
    Effect.objects.filter(pk=effect.pk).update(
        next_attempt_at=timezone.now() - timedelta(seconds=1)
    )


def effect_of(job) -> Effect:
    return Effect.objects.select_related("job").get(job=job)


def test_paused_provider__deferred_without_an_attempt__resumed_sends(make_user, webhook):
    flow.pause("provider:webhook", actor="test")
    user = make_user()
    job = notify_job(user)
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.PENDING and effect.attempts == 0
    assert effect.next_attempt_at is not None
    defer = effect.events.get(action=EffectEvent.Action.DEFER)
    assert defer.error_code == "flow_paused" and defer.note == "provider:webhook"
    assert webhook.record.requests() == []

    flow.resume("provider:webhook", actor="test")
    make_due(effect)
    assert release_effect(effect.pk) == State.APPLIED
    assert effect_of(job).attempts == 1
    assert len(webhook.record.sends()) == 1


def test_provider_rate__sends_spaced_by_the_interval(make_user, webhook, settings):
    settings.JOBS_PROVIDER_SLOT_WAIT_SECONDS = 2.0
    flow.set_rule("provider:webhook", actor="test", rate=5, period_seconds=1.0)
    user = make_user()
    jobs = [notify_job(user, subject=str(n)) for n in range(4)]
    starts = []  # each start by the server's clock: the rule's next free time, less one interval
    for job in jobs:
        run_delivery(job.pk, worker="w1")
        tat = FlowRule.objects.get(scope="provider:webhook").next_free_at
        starts.append((tat - timedelta(seconds=0.2)).timestamp())
    assert Effect.objects.filter(state=State.APPLIED).count() == 4
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= 0.2 - 1e-6, gaps  # the rule itself: 200 ms apart by the server's clock
    # Each call reached the provider after its start was taken and before the next start:
    # the start is the last thing before the call. (How close two arrivals come also
    # depends on how busy the machine is; the soak and the e2e test count windows.)
    received = sorted(r["received_at"] for r in webhook.record.requests())
    assert len(received) == 4
    for n, at in enumerate(received):
        assert starts[n] - 0.01 <= at, (n, starts, received)
        assert n == 3 or at <= starts[n + 1] + 0.01, (n, starts, received)


def test_provider_rate__the_slow_set_up_comes_before_the_start(make_user, webhook, monkeypatch):
    """A process's first client (its TLS context: 0.1-0.3 s on a busy host) is built
    before the rate's start is taken, not between the start and the call."""
    import httpx

    from jobs import registry

    flow.set_rule("provider:webhook", actor="test", rate=5, period_seconds=1.0)
    registry.get_provider("webhook")._local.client = None  # as in a new worker process
    order = []
    real_take, real_init = admission.take, httpx.Client.__init__

    def take(scope):
        order.append("start")
        return real_take(scope)

    def init(self, *args, **kwargs):
        order.append("client")
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(flow, "take", take)
    monkeypatch.setattr(httpx.Client, "__init__", init)
    job = notify_job(make_user())
    run_delivery(job.pk, worker="w1")
    assert effect_of(job).state == State.APPLIED
    assert order == ["client", "start"], order


def test_provider_rate__past_the_wait_budget__deferred_to_the_due_time(
    make_user, webhook, settings
):
    settings.JOBS_PROVIDER_SLOT_WAIT_SECONDS = 0.2
    flow.set_rule("provider:webhook", actor="test", rate=1, period_seconds=60.0)
    user = make_user()
    first, second = notify_job(user, subject="1"), notify_job(user, subject="2")
    run_delivery(first.pk, worker="w1")
    run_delivery(second.pk, worker="w1")
    held = effect_of(second)
    assert effect_of(first).state == State.APPLIED
    assert held.state == State.PENDING and held.attempts == 0
    assert held.events.get(action=EffectEvent.Action.DEFER).error_code == "rate_limited"
    ahead = (held.next_attempt_at - timezone.now()).total_seconds()
    assert 50 < ahead < 125, "due at the next free start, spread over the period"
    assert len(webhook.record.requests()) == 1


def test_provider_concurrency_from_the_row_wins_over_the_setting(make_user, webhook, settings):
    settings.NOTICE_PROVIDER_MAX_IN_FLIGHT = 4
    flow.set_rule("provider:webhook", actor="test", concurrency=2)
    gate = flow.provider_gate("webhook", 4, lambda: "", "w1")
    assert gate.limits == [("webhook", 2)]
    flow.set_rule("provider:webhook", actor="test", concurrency=None)
    assert flow.provider_gate("webhook", 4, lambda: "", "w1").limits == [("webhook", 4)]


def test_partition_rule__applies_to_its_tenant_only(make_user, webhook):
    flow.set_rule("provider:webhook/tenant:acme", actor="test", concurrency=1, rate=2)
    acme = flow.provider_gate("webhook", 4, lambda: "acme", "w1")
    other = flow.provider_gate("webhook", 4, lambda: "beta", "w1")
    assert acme.limits == [("webhook", 4), ("provider:webhook/tenant:acme", 1)]
    assert [r.scope for r in acme.rated] == ["provider:webhook/tenant:acme"]
    assert other.limits == [("webhook", 4)] and other.rated == []


# --- the circuit breaker ---------------------------------------------------------------


def test_circuit__opens_after_n_failures__waiting_effects_spend_no_attempt__probe_closes(
    make_user, webhook, settings
):
    settings.JOBS_CIRCUIT_FAILURES = 3
    settings.JOBS_CIRCUIT_PROBE_SECONDS = 30.0  # the test moves the probe time itself
    settings.JOBS_CIRCUIT_PROBE_CAP_SECONDS = 120.0
    settings.JOBS_FLOW_CACHE_SECONDS = 0.0
    webhook.faults.unavailable = 1.0
    webhook.faults.retry_after = 0
    user = make_user()
    jobs = [notify_job(user, subject=str(n)) for n in range(6)]
    for job in jobs:
        run_delivery(job.pk, worker="w1")
    rule = FlowRule.objects.get(scope="provider:webhook")
    assert rule.circuit_state == Circuit.OPEN and rule.circuit_failures == 3
    effects = [effect_of(j) for j in jobs]
    assert [e.attempts for e in effects] == [1, 1, 1, 0, 0, 0], "held at the gate: no attempt"
    assert len(webhook.record.requests()) == 3
    for e in effects[3:]:
        assert e.events.filter(action=EffectEvent.Action.DEFER, error_code="circuit_open").exists()

    # The probe time comes; one sender probes (and fails): the interval grows.
    probe_time_comes()
    make_due(effects[3])
    assert release_effect(effects[3].pk) == State.PENDING
    rule.refresh_from_db()
    assert rule.circuit_state == Circuit.OPEN and rule.circuit_probes == 1
    assert (rule.circuit_probe_at - timezone.now()).total_seconds() > 45, "30 s doubled"
    assert effect_of(jobs[3]).attempts == 1, "the probe spent its attempt"
    make_due(effects[4])
    assert release_effect(effects[4].pk) == "deferred", "not yet time for the next probe"
    assert effect_of(jobs[4]).attempts == 0

    # The provider recovers; the next probe succeeds and closes the circuit.
    webhook.faults.unavailable = 0.0
    probe_time_comes()
    make_due(effects[4])
    assert release_effect(effects[4].pk) == State.APPLIED
    rule.refresh_from_db()
    assert rule.circuit_state == Circuit.CLOSED and rule.circuit_failures == 0
    for e in effects:
        make_due(e)
        release_effect(e.pk)
    assert Effect.objects.filter(state=State.APPLIED).count() == 6
    assert webhook.record.duplicate_effects() == {}
    actions = list(FlowRuleChange.objects.order_by("id").values_list("action", "after"))
    assert [a for a, _ in actions] == ["circuit", "circuit", "circuit"]
    assert actions[0][1].startswith("open") and actions[-1][1].startswith("closed")


def test_circuit__open_past_the_outage_window__needs_review_with_the_reason(
    make_user, webhook, settings
):
    settings.JOBS_OUTAGE_WINDOW_SECONDS = 0.0
    settings.JOBS_FLOW_CACHE_SECONDS = 0.0
    FlowRule.objects.create(
        scope="provider:webhook",
        circuit_state=Circuit.OPEN,
        circuit_opened_at=timezone.now() - timedelta(seconds=5),
        circuit_probe_at=timezone.now() + timedelta(seconds=60),
    )
    user = make_user()
    job = notify_job(user)
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.NEEDS_REVIEW and effect.attempts == 0
    assert "circuit" in effect.reason and "JOBS_OUTAGE_WINDOW_SECONDS" in effect.reason
    assert webhook.record.requests() == []


def test_circuit__a_success_resets_the_count(make_user, webhook, settings):
    settings.JOBS_CIRCUIT_FAILURES = 3
    webhook.faults.unavailable = 1.0
    webhook.faults.retry_after = 0
    user = make_user()
    a, b = notify_job(user, subject="1"), notify_job(user, subject="2")
    run_delivery(a.pk, worker="w1")
    run_delivery(b.pk, worker="w1")
    assert FlowRule.objects.get(scope="provider:webhook").circuit_failures == 2
    webhook.faults.unavailable = 0.0
    make_due(effect_of(a))
    assert release_effect(effect_of(a).pk) == State.APPLIED
    assert FlowRule.objects.get(scope="provider:webhook").circuit_failures == 0


def test_circuit__a_probe_that_fails_before_its_call_opens_the_way_for_the_next(
    make_user, webhook, settings, monkeypatch
):
    """The probe's own preparation raised: no call was made, so the provider is not judged;
    the circuit is open again at once and the next sender probes."""
    settings.JOBS_FLOW_CACHE_SECONDS = 0.0
    FlowRule.objects.create(
        scope="provider:webhook",
        circuit_state=Circuit.OPEN,
        circuit_opened_at=timezone.now(),
        circuit_probe_at=timezone.now() - timedelta(seconds=1),
    )
    user = make_user()
    first, second = notify_job(user, subject="1"), notify_job(user, subject="2")
    provider = registry.get_provider("webhook")

    def broken_prepare(self, effect):
        raise RuntimeError("client could not be built")

    monkeypatch.setattr(type(provider), "prepare", broken_prepare)
    run_delivery(first.pk, worker="w1")
    rule = FlowRule.objects.get(scope="provider:webhook")
    assert rule.circuit_state == Circuit.OPEN and rule.circuit_prober == ""
    assert rule.circuit_probe_at <= timezone.now(), "the next sender may probe at once"
    assert rule.circuit_probes == 0, "a probe that made no call did not fail"
    assert webhook.record.requests() == []

    monkeypatch.undo()
    run_delivery(second.pk, worker="w2")
    assert effect_of(second).state == State.APPLIED
    assert FlowRule.objects.get(scope="provider:webhook").circuit_state == Circuit.CLOSED


def test_circuit__a_call_answered_while_the_circuit_is_open_is_recorded_as_the_send_it_was(
    make_user, webhook, settings, monkeypatch
):
    """Another sender opened the circuit after this one's gate read it closed: the call
    reached the provider and failed. The history shows that send with its answer (not a
    deferral), and the effect gets its attempt back and waits for the circuit."""
    settings.JOBS_FLOW_CACHE_SECONDS = 0.0
    webhook.faults.unavailable = 1.0
    webhook.faults.retry_after = 0
    provider = registry.get_provider("webhook")
    real_send = provider.send

    def opened_elsewhere_then_send(effect):
        now = timezone.now()
        FlowRule.objects.update_or_create(
            scope="provider:webhook",
            defaults={
                "circuit_state": Circuit.OPEN,
                "circuit_failures": 5,
                "circuit_opened_at": now,
                "circuit_probe_at": now + timedelta(seconds=60),
            },
        )
        return real_send(effect)

    monkeypatch.setattr(provider, "send", opened_elsewhere_then_send)
    job = notify_job(make_user())
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert len(webhook.record.requests()) == 1, "the call reached the provider"
    (send,) = effect.events.filter(action=EffectEvent.Action.SEND)
    assert (send.error_class, send.error_code) == ("temporary", "http_503"), send.__dict__
    assert send.note == "provider:webhook"
    assert not effect.events.filter(action=EffectEvent.Action.DEFER).exists()
    assert effect.state == State.PENDING and effect.attempts == 0, "the outage's, not the effect's"
    assert effect.next_attempt_at is not None
