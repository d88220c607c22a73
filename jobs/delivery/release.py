"""Releasing one effect: recheck the recipient's authorization, then apply or send it.

An external send holds one of the provider's in-flight slots (``jobs.providers.bounds``)
for exactly the duration of the call, and respects the provider's flow rules and
circuit (``jobs.flow``); the recipient's authorization is rechecked inside the slot,
right before the call. Every failure on the way, the authorization recheck included,
goes through the retry table; each outcome is one arrow of ``jobs.engine.effect_machine``.

An effect whose last send may have landed unanswered (``unknown``, or ``sending`` whose
sender's lease ran out) is first looked up by its key where the provider can say
(``Provider.supports_lookup``): found is recorded as applied with the provider's reference
and nothing is sent; never seen lets the send go on; no answer leaves it unknown, to be
asked again later: never a send the provider said nothing about.
"""

from __future__ import annotations

import random
import time

from django.db import transaction

from jobs import conf, flow, registry, rules, sequences, telemetry
from jobs.delivery import policy
from jobs.engine import effect_machine
from jobs.engine.plan import Hold
from jobs.models import Effect
from jobs.providers import ProviderLookupUnsupported
from jobs.retry import classify

State = Effect.State


class _LostSend(Exception):
    """Our sending lease was taken over while the transactional apply ran."""


@telemetry.traced_claim_send
def release(effect: Effect, worker: str) -> str:
    """Recheck authorization and deliver one effect; returns the state it ended in.

    Besides an effect state it may return ``skipped`` (not ours to send now),
    ``deferred`` (every in-flight slot of the provider stayed busy) or
    ``lease_lost`` (another sender took over after our lease ran out).
    """
    prior = effect.state
    claimed = effect_machine.claim_send(effect, worker)
    if claimed != "claimed":
        return claimed
    return send_claimed(effect, worker, prior)


@telemetry.traced_release
def send_claimed(effect: Effect, worker: str, prior: str) -> str:
    """Deliver an effect ``worker`` has leased (``claim_send``; ``prior``: its state before);
    returns the state it ended in, as ``release``. A settled outcome may let the job's
    sequence go on (``sequences.moved``)."""
    outcome = _send_claimed(effect, worker, prior)
    sequences.moved(effect.job)
    return outcome


def _send_claimed(effect: Effect, worker: str, prior: str) -> str:
    provider = registry.get_provider(effect.provider)
    if provider.transactional:
        return _release_transactional(effect, worker, provider)
    # An earlier send may have landed, or a failover lost its rows (jobs.reconcile, issue 47).
    unsure = prior in (State.UNKNOWN, State.SENDING) or effect.job.reconciled_at is not None
    ask = unsure and provider.supports_lookup
    if prior == State.SENDING and not provider.supports_idempotency and not ask:
        # The last sender's lease ran out mid-call: the message may be out, and a
        # provider without keys cannot tell a resend from a new one. An operator decides.
        return effect_machine.sender_lost(effect, worker)

    # Flow rules (jobs.flow): pause, the in-flight bound in force, the rate, the circuit.
    gate = flow.provider_gate(
        provider.name, provider.in_flight_limit(), lambda: effect.job.tenant_key, worker
    )
    if gate.review:
        return effect_machine.circuit_expired(effect, worker, gate.review)
    if gate.hold is not None:
        return effect_machine.defer(effect, worker, prior, hold=gate.hold)
    # One budget for the slots and the rate: a send still ends within its lease (E010).
    deadline = time.monotonic() + float(conf.get("JOBS_PROVIDER_SLOT_WAIT_SECONDS"))
    slot = reason = ref = held = found = None
    called = looking = lost = False
    try:
        provider.prepare(effect)  # the slow part of a send, before its start is taken
        with flow.slots(gate, deadline=deadline) as slot:
            if slot and ask:
                # A lookup holds an in-flight slot like a send (the provider's bound
                # counts every call) but takes no rate start: it is no notice.
                looking = True
                found = _look_up(provider, effect, worker)
                looking = False
                # Not seen yet, but a lost sender's call may still arrive, and a provider
                # without keys would apply it twice: an operator decides.
                lost = found is None and prior == State.SENDING
                lost = lost and not provider.supports_idempotency
            if slot and found is None and not lost:
                # Inside the slot: the current policy, then the rate's start, then the
                # call; nothing stands between the start and the call.
                held, reason = flow.take_within(
                    gate, deadline=deadline, check=lambda: policy.withhold_reason(effect)
                )
                if held is None and not reason:
                    called = True
                    ref = provider.send(effect)
    except Exception as exc:  # the retry table decides, not this except
        # A lookup that failed: the provider could not say; still unknown, asked again later.
        return _failed(
            effect,
            worker,
            provider,
            exc,
            called=called or looking,
            prior=prior,
            probe=gate.probe,
            looked_up=looking,
        )
    finally:
        if gate.probe and not (called or looking) and found is None:
            # The provider was not asked (or only told us it never saw the key, and no
            # send followed): another sender probes.
            flow.probe_abandoned(provider.name, worker)
    return _recorded(
        effect,
        worker,
        provider,
        prior,
        slot=slot,
        lost=lost,
        found=found,
        held=held,
        reason=reason,
        ref=ref,
    )


def _recorded(effect: Effect, worker: str, provider, prior: str, **how) -> str:
    """The ledger's arrow for how the send went (``send_claimed``'s outcome)."""
    if not how["slot"]:
        return effect_machine.defer(effect, worker, prior)
    if how["lost"]:
        return effect_machine.sender_lost(effect, worker)
    if how["found"] is not None:
        outcome = effect_machine.found_applied(effect, worker, how["found"])
        flow.circuit_success(provider.name, worker)  # the provider answered
        return outcome
    if how["held"] is not None:
        return effect_machine.defer(effect, worker, prior, hold=how["held"])
    if how["reason"]:
        return effect_machine.withhold(effect, worker, how["reason"])
    outcome = effect_machine.applied(effect, worker, how["ref"])
    # After the ledger committed: the count restarts, an open circuit closes.
    flow.circuit_success(provider.name, worker)
    return outcome


@telemetry.traced_lookup
def _look_up(provider, effect: Effect, worker: str) -> str | None:
    """The provider's reference for the effect's key, or None when the send should go on:
    the provider never saw the key, or it turned out to have no lookup (today's rule)."""
    try:
        ref = provider.lookup(effect.idempotency_key)
    except ProviderLookupUnsupported:
        effect_machine.log_outcome(effect, "looked_up", worker, lookup="unsupported")
        return None
    if ref is None:
        effect_machine.not_found(effect, worker)
    return ref


def _release_transactional(effect: Effect, worker: str, provider) -> str:
    try:
        reason = policy.withhold_reason(effect)
        if not reason:
            with transaction.atomic():
                ref = provider.apply(effect)
                if effect_machine.applied(effect, worker, ref) != State.APPLIED:
                    raise _LostSend
    except _LostSend:
        return "lease_lost"
    except Exception as exc:  # the retry table decides; the apply rolled back: nothing landed
        return _failed(effect, worker, provider, exc, called=False, prior=State.PENDING)
    return effect_machine.withhold(effect, worker, reason) if reason else State.APPLIED


def _failed(
    effect: Effect,
    worker: str,
    provider,
    exc: BaseException,
    *,
    called: bool,
    prior: str,
    probe: bool = False,
    looked_up: bool = False,
) -> str:
    """A failed release, by the retry table.

    A failed call of the classes that open a provider's circuit is counted on its row
    (``jobs.flow``); one that failed while the circuit is open (it opened now, or
    another sender opened it after this one read it closed) belongs to the outage: it
    is recorded as the send it was, with its answer, and the effect gets its attempt
    back and waits, as if it had been held at the gate. ``looked_up``: the failed call
    was a lookup: recorded as one, and the effect stays unknown whatever the class.
    """
    c = classify(exc)
    outage = called and c.error_class in flow.CIRCUIT_CLASSES
    if outage and flow.circuit_failure(provider.name, worker, probe=probe):
        hold = Hold(rules.provider_scope(provider.name), "circuit_open", 1.0)
        hold, unsure = _later(hold, c.retry_after), c.rule.may_have_landed or looked_up
        return effect_machine.defer(
            effect, worker, prior, hold=hold, unsure=unsure, answer=c, looked_up=looked_up
        )
    return effect_machine.record_failure(
        effect,
        worker,
        c,
        called=called,
        prior=prior,
        dedupes=provider.supports_idempotency,
        looked_up=looked_up,
    )


def _later(hold: Hold, retry_after: float | None) -> Hold:
    """The hold, no earlier than the provider's Retry-After, jittered."""
    delay = max(hold.delay, retry_after or 0.0) * (1 + random.random())
    return Hold(hold.scope, hold.reason, delay)
