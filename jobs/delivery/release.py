"""Releasing one effect: recheck the recipient's authorization, then apply or send it.

An external send holds one of the provider's in-flight slots (``jobs.providers.bounds``)
for exactly the duration of the call, and respects the provider's flow rules and
circuit (``jobs.flow``); the recipient's authorization is rechecked inside the slot,
right before the call. Every failure on the way, the authorization recheck included,
goes through the retry table; each outcome is one arrow of ``jobs.engine.effect_machine``.
"""

from __future__ import annotations

import random
import time

from django.db import transaction

from jobs import conf, flow, registry, rules
from jobs.delivery import policy
from jobs.engine import effect_machine
from jobs.engine.plan import Hold
from jobs.models import Effect
from jobs.retry import classify

State = Effect.State


class _LostSend(Exception):
    """Our sending lease was taken over while the transactional apply ran."""


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


def send_claimed(effect: Effect, worker: str, prior: str) -> str:
    """Deliver an effect ``worker`` has leased (``claim_send``; ``prior``: its state before);
    returns the state it ended in, as ``release``."""
    provider = registry.get_provider(effect.provider)
    if provider.transactional:
        return _release_transactional(effect, worker, provider)
    if prior == State.SENDING and not provider.supports_idempotency:
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
    slot = reason = ref = held = None
    called = False
    try:
        provider.prepare(effect)  # the slow part of a send, before its start is taken
        with flow.slots(gate, deadline=deadline) as slot:
            if slot:
                # Inside the slot: the current policy, then the rate's start, then the
                # call; nothing stands between the start and the call.
                held, reason = flow.take_within(
                    gate, deadline=deadline, check=lambda: policy.withhold_reason(effect)
                )
                if held is None and not reason:
                    called = True
                    ref = provider.send(effect)
    except Exception as exc:  # the retry table decides, not this except
        return _failed(effect, worker, provider, exc, called=called, prior=prior, probe=gate.probe)
    finally:
        if gate.probe and not called:  # the provider was not asked: another sender probes
            flow.probe_abandoned(provider.name, worker)
    if not slot:
        return effect_machine.defer(effect, worker, prior)
    if held is not None:
        return effect_machine.defer(effect, worker, prior, hold=held)
    if reason:
        return effect_machine.withhold(effect, worker, reason)
    outcome = effect_machine.applied(effect, worker, ref)
    # After the ledger committed: the count restarts, an open circuit closes.
    flow.circuit_success(provider.name, worker)
    return outcome


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
) -> str:
    """A failed release, by the retry table.

    A failed call of the classes that open a provider's circuit is counted on its row
    (``jobs.flow``); one that failed while the circuit is open (it opened now, or
    another sender opened it after this one read it closed) belongs to the outage: it
    is recorded as the send it was, with its answer, and the effect gets its attempt
    back and waits, as if it had been held at the gate.
    """
    c = classify(exc)
    outage = called and c.error_class in flow.CIRCUIT_CLASSES
    if outage and flow.circuit_failure(provider.name, worker, probe=probe):
        hold = Hold(rules.provider_scope(provider.name), "circuit_open", 1.0)
        hold, unsure = _later(hold, c.retry_after), c.rule.may_have_landed
        return effect_machine.defer(effect, worker, prior, hold=hold, unsure=unsure, answer=c)
    return effect_machine.record_failure(
        effect, worker, c, called=called, prior=prior, dedupes=provider.supports_idempotency
    )


def _later(hold: Hold, retry_after: float | None) -> Hold:
    """The hold, no earlier than the provider's Retry-After, jittered."""
    delay = max(hold.delay, retry_after or 0.0) * (1 + random.random())
    return Hold(hold.scope, hold.reason, delay)
