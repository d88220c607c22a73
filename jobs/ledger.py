"""The effect ledger: one row per business outcome, the only writer of ``Effect.state``.

An effect's identity (``job:revision:name:recipient``) and its idempotency key
are derived, never generated, so every retry, redelivery and re-drive names
the same effect and sends the same key. Rows are inserted in the publish
transaction; a worker that lost its lease publishes nothing, so it records
nothing either.

Delivery is its own small state machine, every arrow a CAS on ``version``
(and the sending lease's owner where it matters):

    pending ──claim_send──▶ sending ──▶ applied | withheld | failed | needs_review
    unknown (due) ─────────▶   │  └────▶ unknown (sent, no answer: retry, same key)
    sending (lease expired) ─▶ │  └────▶ pending (transport/temporary: retry later)
      (provider without keys: ──────▶ needs_review, "sender_lost": never a blind resend)
                               └───────▶ pending/unknown (no in-flight slot: deferred,
                                         no attempt spent)
    needs_review ──mark_sent (operator)──▶ applied
    needs_review ──send_again (operator)─▶ pending
    withheld ──recheck (operator)────────▶ pending

An external send holds one of the provider's in-flight slots
(``jobs.providers.bounds``) for exactly the duration of the call; the
recipient's authorization is rechecked inside the slot, right before the call.
Every call and every operator action leaves an ``EffectEvent``.
"""

from __future__ import annotations

import hashlib
import logging
import random
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from jobs import conf, registry
from jobs.cas import compare_and_swap
from jobs.models import Effect, EffectEvent, Job
from jobs.providers import bounds
from jobs.registry import EffectSpec
from jobs.retry import ErrorClass, classify

log = logging.getLogger("jobs.ledger")

State = Effect.State


def effect_identity(job: Job, name: str, recipient: str) -> str:
    """e.g. ``84:29:completion-notice:47``: the same outcome always has the same id."""
    return f"{job.pk}:{job.output_revision}:{name}:{recipient}"


def idempotency_key(effect_id: str) -> str:
    """Derived from the identity, so a retry can never mint a new key."""
    return "fx-" + hashlib.sha256(effect_id.encode()).hexdigest()[:40]


def record(job: Job, specs: list[EffectSpec], worker: str = "") -> list[Effect]:
    """Insert the job's effects; call inside the publish transaction.

    Effects of a transactional provider (the in-app notice) are released right
    here: their recipient is rechecked and the ledger row goes in already
    ``applied`` (or ``withheld``), with the notice itself, so they commit with
    the job's completion or not at all. The others wait ``pending`` for
    ``release``.
    """
    if not specs:
        return []
    now = timezone.now()
    due = now + timedelta(seconds=conf.effect_grace_seconds())
    rows = []
    seen = set()
    for spec in specs:
        effect_id = effect_identity(job, spec.name, str(spec.recipient))
        if effect_id in seen:  # the same outcome asked for twice is still one outcome
            continue
        seen.add(effect_id)
        effect = Effect(
            effect_id=effect_id,
            job=job,
            name=spec.name,
            provider=spec.provider,
            recipient=str(spec.recipient),
            idempotency_key=idempotency_key(effect_id),
            data=spec.data,
            next_attempt_at=due,
            created_at=now,
            updated_at=now,
        )
        if registry.get_provider(spec.provider).transactional:
            _decide_in_publish(effect, now)
        rows.append(effect)
    Effect.objects.bulk_create(rows)
    _apply_in_publish([e for e in rows if e.state == State.APPLIED], worker)
    EffectEvent.objects.bulk_create(
        [
            _event_row(
                e,
                worker,
                EffectEvent.Action.WITHHOLD,
                State.WITHHELD,
                error_class=ErrorClass.AUTHORIZATION,
                code="recipient_not_authorized",
                note=e.reason,
            )
            for e in rows
            if e.state == State.WITHHELD
        ]
    )
    return rows


def _decide_in_publish(effect: Effect, now) -> None:
    """Recheck the recipient now: the row is born applied or withheld, never pending."""
    reason = withhold_reason(effect)
    effect.attempts = 1
    effect.next_attempt_at = None
    if reason:
        effect.state = State.WITHHELD
        effect.reason = reason[:300]
        effect.last_error_class = ErrorClass.AUTHORIZATION
        effect.last_error_code = "recipient_not_authorized"
    else:
        effect.state = State.APPLIED
        effect.applied_at = now


def _apply_in_publish(effects: list[Effect], worker: str) -> None:
    """Write each transactional effect; one that fails goes back to pending for ``release``."""
    events, refs = [], []
    for effect in effects:
        provider = registry.get_provider(effect.provider)
        try:
            with transaction.atomic():  # a savepoint: a failed apply leaves the publish intact
                effect.provider_ref = str(provider.apply(effect))[:200]
        except Exception as exc:  # the retry table decides, in release
            c = classify(exc)
            effect.state, effect.applied_at, effect.attempts = State.PENDING, None, 0
            effect.last_error_class, effect.last_error_code = c.error_class, c.code
            Effect.objects.filter(pk=effect.pk).update(
                state=State.PENDING,
                applied_at=None,
                attempts=0,
                last_error_class=c.error_class,
                last_error_code=c.code,
                next_attempt_at=timezone.now(),
            )
            continue
        refs.append(effect)
        events.append(_event_row(effect, worker, EffectEvent.Action.SEND, State.APPLIED))
        _log(effect, "applied", worker, ref=effect.provider_ref, with_publish=True)
    if refs:
        Effect.objects.bulk_update(refs, ["provider_ref"])
    EffectEvent.objects.bulk_create(events)


_cas = compare_and_swap


def claim_send(effect: Effect, worker: str, *, own_publish: bool = False) -> bool:
    """Lease the effect to one sender: pending/unknown when due, or sending whose lease expired."""
    now = timezone.now()
    due = effect.next_attempt_at is None or effect.next_attempt_at <= now
    if effect.state == State.PENDING:
        ok = own_publish or due
    elif effect.state == State.UNKNOWN:
        ok = due
    elif effect.state == State.SENDING:
        ok = effect.lease_expires_at is not None and effect.lease_expires_at <= now
    else:
        ok = False
    if not ok:
        return False
    lease = float(conf.get("JOBS_EFFECT_LEASE_SECONDS"))
    return _cas(
        effect,
        state=State.SENDING,
        attempts=effect.attempts + 1,
        lease_owner=worker,
        lease_expires_at=now + timedelta(seconds=lease),
        now=now,
    )


def withhold_reason(effect: Effect) -> str | None:
    """Current policy for this recipient, asked right before the send."""
    user = get_user_model().objects.filter(pk=effect.recipient).first()
    if user is None:
        return "recipient account no longer exists"
    if not user.is_active:
        return "recipient account is inactive"
    kind = registry.get_kind(effect.job.kind)
    if kind.authorize_release is not None:
        return kind.authorize_release(effect)
    return None


def _log(effect: Effect, outcome: str, worker: str, **extra) -> None:
    log.info(
        "effect=%s job=%s provider=%s outcome=%s attempt=%s worker=%s %s",
        effect.effect_id,
        effect.job_id,
        effect.provider,
        outcome,
        effect.attempts,
        worker,
        " ".join(f"{k}={v}" for k, v in extra.items()),
    )


class _LostSend(Exception):
    """Our sending lease was taken over while the transactional apply ran."""


def _event_row(
    effect: Effect, actor: str, action: str, outcome: str, *, error_class="", code="", note=""
) -> EffectEvent:
    return EffectEvent(
        effect=effect,
        provider=effect.provider,
        action=action,
        attempt=effect.attempts,
        actor=actor[:200],
        outcome=outcome,
        error_class=str(error_class),
        error_code=str(code)[:64],
        note=str(note)[:300],
    )


def _event(effect: Effect, actor: str, action: str, outcome: str, **fields) -> None:
    _event_row(effect, actor, action, outcome, **fields).save()


def release(effect: Effect, worker: str, *, own_publish: bool = False) -> str:
    """Recheck authorization and deliver one effect; returns the state it ended in.

    Besides an effect state it may return ``skipped`` (not ours to send now),
    ``deferred`` (every in-flight slot of the provider stayed busy) or
    ``lease_lost`` (another sender took over after our lease ran out).
    """
    prior = effect.state
    if not claim_send(effect, worker, own_publish=own_publish):
        return "skipped"
    provider = registry.get_provider(effect.provider)
    if provider.transactional:
        return _release_transactional(effect, worker, provider)
    if prior == State.SENDING and not provider.supports_idempotency:
        # The last sender's lease ran out mid-call: the message may be out, and a
        # provider without keys cannot tell a resend from a new one. An operator decides.
        return _sender_lost(effect, worker)

    wait = float(conf.get("JOBS_PROVIDER_SLOT_WAIT_SECONDS"))
    ref = failure = None
    with bounds.in_flight(provider.name, provider.in_flight_limit(), wait=wait) as slot:
        if slot is None:
            return _defer(effect, worker, prior)
        # Current policy, asked inside the slot: nothing stands between it and the call.
        reason = withhold_reason(effect)
        if not reason:
            try:
                ref = provider.send(effect)
            except Exception as exc:  # the retry table decides, not this except
                failure = exc
    if reason:
        return _withhold(effect, worker, reason)
    if failure is not None:
        return _record_failure(effect, worker, provider, failure)
    if not _applied(effect, worker, ref):
        # Another sender took over after our lease ran out; the provider
        # deduplicates by key, and the ledger keeps the first outcome.
        _event(effect, worker, EffectEvent.Action.SEND, "lease_lost", note=f"ref {ref}")
        _log(effect, "lease_lost", worker)
        return "lease_lost"
    _event(effect, worker, EffectEvent.Action.SEND, State.APPLIED)
    _log(effect, "applied", worker, ref=effect.provider_ref)
    return State.APPLIED


def _release_transactional(effect: Effect, worker: str, provider) -> str:
    reason = withhold_reason(effect)
    if reason:
        return _withhold(effect, worker, reason)
    try:
        with transaction.atomic():
            ref = provider.apply(effect)
            if not _applied(effect, worker, ref):
                raise _LostSend
            _event(effect, worker, EffectEvent.Action.SEND, State.APPLIED)
    except _LostSend:
        _log(effect, "lease_lost", worker)
        return "lease_lost"
    except Exception as exc:  # the retry table decides, not this except
        return _record_failure(effect, worker, provider, exc)
    _log(effect, "applied", worker, ref=effect.provider_ref)
    return State.APPLIED


def _withhold(effect: Effect, worker: str, reason: str) -> str:
    if _cas(
        effect,
        owner=worker,
        state=State.WITHHELD,
        reason=reason[:300],
        lease_expires_at=None,
        last_error_class=ErrorClass.AUTHORIZATION,
        last_error_code="recipient_not_authorized",
    ):
        _event(
            effect,
            worker,
            EffectEvent.Action.WITHHOLD,
            State.WITHHELD,
            error_class=ErrorClass.AUTHORIZATION,
            code="recipient_not_authorized",
            note=reason,
        )
    _log(effect, "withheld", worker)
    return State.WITHHELD


def _sender_lost(effect: Effect, worker: str) -> str:
    _cas(
        effect,
        owner=worker,
        state=State.NEEDS_REVIEW,
        attempts=max(0, effect.attempts - 1),  # this claim sent nothing
        lease_expires_at=None,
        reason="a sender stopped mid-send; it may have arrived and the provider cannot deduplicate",
        last_error_class=ErrorClass.PROVIDER_TIMEOUT,
        last_error_code="sender_lost",
    )
    _log(effect, State.NEEDS_REVIEW, worker, code="sender_lost")
    return State.NEEDS_REVIEW


def _defer(effect: Effect, worker: str, prior: str) -> str:
    """No in-flight slot freed in time: hand the effect back, spending no attempt."""
    now = timezone.now()
    # A re-driven expired send may have landed: it goes back as unknown, not pending.
    state = prior if prior in (State.PENDING, State.UNKNOWN) else State.UNKNOWN
    delay = float(conf.get("JOBS_PROVIDER_DEFER_SECONDS")) * (1 + random.random())
    _cas(
        effect,
        owner=worker,
        state=state,
        attempts=max(0, effect.attempts - 1),
        lease_expires_at=None,
        next_attempt_at=now + timedelta(seconds=delay),
        now=now,
    )
    _log(effect, "deferred", worker, reason="provider_busy", delay=f"{delay:.2f}")
    return "deferred"


def _applied(effect: Effect, worker: str, ref: str) -> bool:
    now = timezone.now()
    return _cas(
        effect,
        owner=worker,
        state=State.APPLIED,
        provider_ref=str(ref)[:200],
        applied_at=now,
        lease_expires_at=None,
        reason="",
        last_error_class="",
        last_error_code="",
        now=now,
    )


def _failure_state(effect: Effect, provider, c, exc: BaseException) -> tuple[str, str]:
    """The state a failed send leads to, and the reason an operator reads."""
    out_of_budget = effect.attempts >= int(conf.get("JOBS_EFFECT_MAX_ATTEMPTS"))
    if c.code == "provider_not_configured":
        return State.NEEDS_REVIEW, c.detail or str(exc)
    if c.error_class == ErrorClass.VALIDATION:
        if c.code == "http_409":
            return State.FAILED, "provider saw this idempotency key with a different body (409)"
        return State.FAILED, f"provider rejected the notice as invalid ({c.code})"
    if c.error_class == ErrorClass.AUTHORIZATION:
        return State.NEEDS_REVIEW, f"provider refused our credentials ({c.code})"
    if c.error_class == ErrorClass.PROVIDER_TIMEOUT and not provider.supports_idempotency:
        return State.NEEDS_REVIEW, "sent without an answer; provider cannot deduplicate"
    if out_of_budget:
        return State.NEEDS_REVIEW, f"send attempts exhausted (last: {c.code})"
    if c.error_class == ErrorClass.PROVIDER_TIMEOUT:
        return State.UNKNOWN, "sent without an answer; will retry with the same key"
    return State.PENDING, ""


def _record_failure(effect: Effect, worker: str, provider, exc: BaseException) -> str:
    c = classify(exc)
    now = timezone.now()
    state, reason = _failure_state(effect, provider, c, exc)
    changes = {"state": state, "reason": reason[:300], "lease_expires_at": None}
    if state in (State.PENDING, State.UNKNOWN):
        # Floor + full jitter: senders that failed together in an outage do not
        # come back together; Retry-After from the provider is a lower bound.
        delay = conf.backoff(effect.attempts, retry_after=c.retry_after)
        changes["next_attempt_at"] = now + timedelta(seconds=delay)
    won = _cas(
        effect,
        owner=worker,
        last_error_class=c.error_class,
        last_error_code=c.code,
        now=now,
        **changes,
    )
    _event(
        effect,
        worker,
        EffectEvent.Action.SEND,
        state if won else "lease_lost",
        error_class=c.error_class,
        code=c.code,
    )
    _log(effect, state if won else "lease_lost", worker, error_class=c.error_class, code=c.code)
    return state if won else "lease_lost"


def release_published(effects: list[Effect], worker: str) -> dict[str, str]:
    """Release the pending effects this worker just published (external providers)."""
    return {
        e.effect_id: release(e, worker, own_publish=True)
        for e in effects
        if e.state == State.PENDING
    }


def recheck_withheld(effect: Effect, *, operator: str = "operator") -> bool:
    """Operator: put a withheld effect back to pending so release rechecks policy."""
    if effect.state != State.WITHHELD:
        return False
    won = _cas(
        effect, state=State.PENDING, reason="", next_attempt_at=timezone.now(), enqueued_for=None
    )
    if won:
        _event(effect, f"operator:{operator}", EffectEvent.Action.RECHECK, State.PENDING)
    return won


def mark_sent(effect: Effect, *, operator: str, note: str = "") -> bool:
    """Operator: a needs_review effect is known to have arrived (checked out of band)."""
    if effect.state != State.NEEDS_REVIEW:
        return False
    now = timezone.now()
    won = _cas(
        effect,
        state=State.APPLIED,
        applied_at=now,
        provider_ref=effect.provider_ref or "marked-sent",
        reason=f"marked sent by operator {operator}"[:300],
        lease_expires_at=None,
        now=now,
    )
    if won:
        _event(
            effect, f"operator:{operator}", EffectEvent.Action.MARK_SENT, State.APPLIED, note=note
        )
        _log(effect, "marked_sent", f"operator:{operator}")
    return won


def send_again(effect: Effect, *, operator: str, note: str = "") -> bool:
    """Operator: send a needs_review effect once more (same key; e-mail may arrive twice)."""
    if effect.state != State.NEEDS_REVIEW:
        return False
    now = timezone.now()
    won = _cas(
        effect,
        state=State.PENDING,
        reason="",
        next_attempt_at=now,
        enqueued_for=None,
        lease_expires_at=None,
        now=now,
    )
    if won:
        _event(
            effect, f"operator:{operator}", EffectEvent.Action.SEND_AGAIN, State.PENDING, note=note
        )
        _log(effect, "send_again", f"operator:{operator}")
    return won
