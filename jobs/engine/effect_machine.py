"""The effect ledger: one row per business outcome, the only writer of ``Effect.state``.

An effect's identity (``job uid:revision:name:recipient``) and its idempotency key
are derived, never generated, so every retry, redelivery and re-drive names
the same effect and sends the same key. Rows are inserted with the publish
(``jobs.delivery.publish``); a worker that lost its lease publishes nothing, so it
records nothing either.

Delivery is its own small state machine, every arrow a CAS on ``version``
(and the sending lease's owner where it matters) that commits together with
its ``EffectEvent`` (the event carries the version it recorded):

    pending ──claim_send──▶ sending ──▶ applied | withheld | failed | needs_review
    unknown (due) ─────────▶   │  └────▶ unknown (may have landed: retry, same key)
    sending (lease expired) ─▶ │  └────▶ pending (nothing landed: retry later)
      (provider with lookup: asked first: found ──▶ applied, its reference, no send;
       never seen ──▶ the send goes on; no answer ──▶ unknown, asked again later)
      (provider without keys: ──────▶ needs_review, "sender_lost": never a blind resend)
                               └───────▶ pending/unknown (no in-flight slot: deferred,
                                         no attempt spent)
    pending/unknown/sending ──claim_send, budget spent──▶ needs_review (never another send)
    needs_review ──mark_sent (operator)──▶ applied
    needs_review ──send_again (operator)─▶ pending (+ a message, fresh budget)
    withheld ──recheck (operator)────────▶ pending (+ a message, fresh budget)

Every failure on the release path, the authorization recheck included, goes
through the retry table (``jobs.retry.effect_outcome``). An external send
holds one of the provider's in-flight slots (``jobs.providers.bounds``) for
exactly the duration of the call; the recipient's authorization is rechecked
inside the slot, right before the call. Operator actions change the row and
enqueue a message in one transaction and return at once: a worker sends.
"""

from __future__ import annotations

import hashlib
import logging
import random

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from jobs import clock, conf, identity, queue, registry, rules
from jobs.engine.cas import compare_and_swap
from jobs.engine.plan import Hold
from jobs.models import Effect, EffectEvent, Job
from jobs.retry import Classified, ErrorClass, classify, effect_outcome

log = logging.getLogger("jobs.ledger")

State = Effect.State


def effect_identity(job: Job, name: str, recipient: str) -> str:
    """``<job uid>:29:completion-notice:47``: the same outcome always has the same id, and
    no other outcome ever has it (the uid, not the id a failover can repeat)."""
    return f"{identity.job_key(job)}:{job.output_revision}:{name}:{recipient}"


def idempotency_key(effect_id: str) -> str:
    """Derived from the identity, so a retry can never mint a new key."""
    return "fx-" + hashlib.sha256(effect_id.encode()).hexdigest()[:40]


def log_born(rows, worker: str) -> None:
    """The log lines of effects released with the publish (after it committed)."""
    for e in rows:
        if e.state == State.APPLIED:
            log_outcome(e, "applied", worker, ref=e.provider_ref, with_publish=True)


def withhold_event(effect: Effect, worker: str) -> EffectEvent:
    return _event_row(
        effect,
        worker,
        EffectEvent.Action.WITHHOLD,
        error_class=ErrorClass.AUTHORIZATION,
        code="recipient_not_authorized",
        note=effect.reason,
    )


def send_event(effect: Effect, worker: str) -> EffectEvent:
    return _event_row(effect, worker, EffectEvent.Action.SEND)


def check_failed_event(effect: Effect, worker: str) -> EffectEvent:
    """A release check that raised in the publish: recorded, then retried by the table."""
    return _event_row(
        effect,
        worker,
        EffectEvent.Action.CHECK,
        error_class=effect.last_error_class,
        code=effect.last_error_code,
    )


def apply_failed(effect: Effect, worker: str, exc: BaseException) -> EffectEvent:
    """A transactional apply (or building its notice) failed: back to pending, by the table."""
    c = classify(exc)
    effect.state, effect.applied_at, effect.version = State.PENDING, None, 1
    effect.last_error_class, effect.last_error_code = c.error_class, c.code
    effect.next_attempt_at = Now()
    log_outcome(effect, "apply_failed", worker, error_class=c.error_class, code=c.code)
    return _event_row(
        effect, worker, EffectEvent.Action.SEND, error_class=c.error_class, code=c.code
    )


def apply_in_publish(effects: list[Effect], worker: str) -> list[EffectEvent]:
    """Apply each effect of a transactional provider (not the in-app notice, whose row
    is in the plan) in a savepoint; one whose apply fails goes back to pending.

    Returns the events to insert: the send of each applied effect (version 0, born
    applied) or, for a failed apply, the arrow back to pending (version 1).
    """
    events, refs, failed = [], [], []
    for effect in effects:
        provider = registry.get_provider(effect.provider)
        try:
            with transaction.atomic():  # a savepoint: a failed apply leaves the publish intact
                effect.provider_ref = str(provider.apply(effect))[:200]
        except Exception as exc:  # the retry table decides, in release
            events.append(apply_failed(effect, worker, exc))
            failed.append(effect)
            continue
        refs.append(effect)
        events.append(send_event(effect, worker))
    if refs:
        Effect.objects.bulk_update(refs, ["provider_ref"])
    if failed:
        fields = ["state", "applied_at", "version", "last_error_class", "last_error_code"]
        Effect.objects.bulk_update(failed, [*fields, "next_attempt_at"])
    return events


_cas = compare_and_swap


def _event_row(
    effect: Effect, actor: str, action: str, outcome: str = "", *, error_class="", code="", note=""
) -> EffectEvent:
    return EffectEvent(
        effect=effect,
        provider=effect.provider,
        action=action,
        attempt=effect.attempts,
        version=effect.version,
        actor=actor[:200],
        outcome=outcome or effect.state,
        error_class=str(error_class),
        error_code=str(code)[:64],
        note=str(note)[:300],
    )


def _move(
    effect: Effect,
    actor: str,
    action: str,
    *,
    owner: str | None = None,
    where: Q | None = None,
    error_class: str = "",
    code: str = "",
    note: str = "",
    **changes,
) -> bool:
    """One ledger arrow: the CAS and its event commit together, or neither does."""
    with transaction.atomic():
        if not _cas(effect, owner=owner, where=where, **changes):
            return False
        _event_row(effect, actor, action, error_class=error_class, code=code, note=note).save()
    return True


def claim_send(effect: Effect, worker: str) -> str:
    """Lease the effect to one sender: pending/unknown when due, or sending whose lease expired.

    Due-ness is part of the UPDATE's WHERE, judged by the server's clock. Returns
    ``claimed``, ``skipped`` (not due, or another sender moved first) or
    ``needs_review`` (the send budget is spent: no further send, an operator decides).
    """
    if effect.state not in (State.PENDING, State.UNKNOWN, State.SENDING):
        return "skipped"
    due = rules.to_q(rules.EFFECT_RELEASABLE)
    if effect.attempts >= effect.max_attempts:
        won = _move(
            effect,
            worker,
            EffectEvent.Action.STOP,
            where=due,
            code="budget_spent",
            state=State.NEEDS_REVIEW,
            reason=f"send attempts exhausted ({effect.attempts} of {effect.max_attempts})",
            lease_expires_at=None,
            next_attempt_at=None,
            last_error_code="budget_spent",
        )
        if won:
            log_outcome(effect, State.NEEDS_REVIEW, worker, code="budget_spent")
        return State.NEEDS_REVIEW if won else "skipped"
    lease = float(conf.get("JOBS_EFFECT_LEASE_SECONDS"))
    won = _move(
        effect,
        worker,
        EffectEvent.Action.CLAIM,
        where=due,
        state=State.SENDING,
        attempts=effect.attempts + 1,
        lease_owner=worker,
        lease_expires_at=clock.after(lease),
    )
    return "claimed" if won else "skipped"


def log_outcome(effect: Effect, outcome: str, worker: str, **extra) -> None:
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


def applied(effect: Effect, worker: str, ref) -> str:
    """sending → applied: the provider answered the send with its reference."""
    return _applied(effect, worker, ref, found=False)


def found_applied(effect: Effect, worker: str, ref: str) -> str:
    """The provider's lookup says it applied a send under the key: recorded as applied
    with its reference, and nothing is sent (the answer to the first send was lost)."""
    return _applied(effect, worker, ref, found=True)


def _applied(effect: Effect, worker: str, ref, *, found: bool) -> str:
    """The one arrow to applied, from a send's answer or a lookup's ``found``: the
    reference recorded, the lease and the last error cleared."""
    action = EffectEvent.Action.LOOKUP if found else EffectEvent.Action.SEND
    code = "found" if found else ""
    won = _move(
        effect,
        worker,
        action,
        owner=worker,
        code=code,
        state=State.APPLIED,
        provider_ref=str(ref)[:200],
        applied_at=Now(),
        lease_expires_at=None,
        reason="",
        last_error_class="",
        last_error_code="",
    )
    lookup = {"lookup": "found"} if found else {}
    if not won:
        # Another sender took over after our lease ran out; the provider
        # deduplicates by key, and the ledger keeps the first outcome.
        note = "" if found else f"ref {ref}"
        _event_row(effect, worker, action, "lease_lost", code=code, note=note).save()
        log_outcome(effect, "lease_lost", worker, **lookup)
        return "lease_lost"
    log_outcome(effect, "applied", worker, ref=effect.provider_ref, **lookup)
    return State.APPLIED


def not_found(effect: Effect, worker: str) -> None:
    """The provider's lookup says it never saw the key: noted (no arrow); the send goes on."""
    _event_row(effect, worker, EffectEvent.Action.LOOKUP, "not_found", code="not_found").save()
    log_outcome(effect, "looked_up", worker, lookup="not_found")


def withhold(effect: Effect, worker: str, reason: str) -> str:
    won = _move(
        effect,
        worker,
        EffectEvent.Action.WITHHOLD,
        owner=worker,
        error_class=ErrorClass.AUTHORIZATION,
        code="recipient_not_authorized",
        note=reason,
        state=State.WITHHELD,
        reason=reason[:300],
        lease_expires_at=None,
        last_error_class=ErrorClass.AUTHORIZATION,
        last_error_code="recipient_not_authorized",
    )
    log_outcome(effect, "withheld" if won else "lease_lost", worker)
    return State.WITHHELD if won else "lease_lost"


def stop_for_review(
    effect: Effect, worker: str, *, error_class: str, code: str, reason: str, log_code: str
) -> str:
    """This claim sent nothing and must not send: the effect waits for a person
    (``needs_review``), its attempt given back."""
    won = _move(
        effect,
        worker,
        EffectEvent.Action.STOP,
        owner=worker,
        error_class=error_class,
        code=code,
        state=State.NEEDS_REVIEW,
        attempts=max(0, effect.attempts - 1),  # this claim sent nothing
        lease_expires_at=None,
        next_attempt_at=None,
        reason=reason[:300],
        last_error_class=error_class,
        last_error_code=code,
    )
    log_outcome(effect, State.NEEDS_REVIEW if won else "lease_lost", worker, code=log_code)
    return State.NEEDS_REVIEW if won else "lease_lost"


def sender_lost(effect: Effect, worker: str) -> str:
    return stop_for_review(
        effect,
        worker,
        error_class=ErrorClass.PROVIDER_TIMEOUT,
        code="sender_lost",
        reason="a sender stopped mid-send; it may have arrived and the provider cannot deduplicate",
        log_code="sender_lost",
    )


def defer(
    effect: Effect,
    worker: str,
    prior: str,
    *,
    hold: Hold | None = None,
    unsure: bool = False,
    answer: Classified | None = None,
    looked_up: bool = False,
) -> str:
    """No in-flight slot freed in time, or a flow rule holds the provider back (``hold``:
    paused, rate, open circuit): hand the effect back, spending no attempt.

    ``answer``: the call reached the provider and failed while its circuit is open. It
    is recorded as the send it was, with the provider's answer, and the effect waits
    for the circuit like one held at the gate (the outage, not the effect, failed);
    ``looked_up``: that call was a lookup, recorded as one (it is no send)."""
    # A re-driven expired send may have landed: it goes back as unknown, not pending.
    state = prior if prior in (State.PENDING, State.UNKNOWN) and not unsure else State.UNKNOWN
    if hold is None:
        delay = float(conf.get("JOBS_PROVIDER_DEFER_SECONDS")) * (1 + random.random())
        code = "provider_busy"
    else:
        delay, code = hold.delay, hold.code
    action, error_class = EffectEvent.Action.DEFER, ""
    if answer is not None:
        action = EffectEvent.Action.LOOKUP if looked_up else EffectEvent.Action.SEND
        error_class, code = answer.error_class, answer.code
    won = _move(
        effect,
        worker,
        action,
        owner=worker,
        error_class=error_class,
        code=code,
        note=hold.scope if hold is not None else "",
        state=state,
        attempts=max(0, effect.attempts - 1),
        lease_expires_at=None,
        next_attempt_at=clock.after(delay),
    )
    log_outcome(effect, "deferred", worker, reason=code, delay=f"{delay:.2f}")
    if won:
        _wake_when_due()
    return "deferred" if won else "lease_lost"


def _wake_when_due() -> None:
    """An effect's due time is its queue entry: idle clusters are woken to learn the new
    one when this commits."""
    queue.notify_queues([rules.DEFAULT_QUEUE])


def circuit_expired(effect: Effect, worker: str, reason: str) -> str:
    """The provider's circuit stayed open past the outage window: a person decides."""
    return stop_for_review(
        effect,
        worker,
        error_class=ErrorClass.TEMPORARY,
        code="circuit_open_too_long",
        reason=reason,
        log_code="circuit_open",
    )


def record_failure(
    effect: Effect,
    worker: str,
    c: Classified,
    *,
    called: bool,
    prior: str,
    dedupes: bool,
    looked_up: bool = False,
) -> str:
    """Write what the retry table says a failed release means (``c``: the failure,
    classified; ``called``: the call reached the provider; ``dedupes``: the provider
    deduplicates by key; ``looked_up``: the call was a lookup, which failed: an earlier
    send may have landed, so the effect stays unknown, never pending)."""
    verdict = effect_outcome(
        c,
        attempts=effect.attempts,
        max_attempts=effect.max_attempts,
        called=called,
        dedupes=dedupes,
        unsure=prior == State.UNKNOWN or looked_up,
    )
    changes = {"state": verdict.state, "reason": verdict.reason[:300], "lease_expires_at": None}
    if verdict.retry:
        # Floor + full jitter: senders that failed together in an outage do not
        # come back together; Retry-After from the provider is a lower bound.
        delay = conf.backoff(effect.attempts, retry_after=c.retry_after)
        changes["next_attempt_at"] = clock.after(delay)
    action = EffectEvent.Action.SEND if called else EffectEvent.Action.CHECK
    if looked_up:
        action = EffectEvent.Action.LOOKUP
    fields = {"error_class": c.error_class, "code": c.code}
    won = _move(
        effect,
        worker,
        action,
        owner=worker,
        last_error_class=c.error_class,
        last_error_code=c.code,
        **fields,
        **changes,
    )
    if not won:
        _event_row(effect, worker, action, "lease_lost", **fields).save()
    elif verdict.retry:
        _wake_when_due()
    outcome = verdict.state if won else "lease_lost"
    log_outcome(effect, outcome, worker, error_class=c.error_class, code=c.code)
    return outcome


# --- operator actions: change the row and enqueue in one transaction, return at once ---


def _operator_move(effect: Effect, operator: str, action: str, *, enqueue: bool, **fields) -> bool:
    with transaction.atomic():
        if not _move(effect, f"operator:{operator}", action, **fields):
            return False
        if enqueue:
            queue.enqueue_effect(effect)
    log_outcome(effect, action, f"operator:{operator}")
    return True


def _resend(effect: Effect, operator: str, action: str, from_state: str, note: str) -> bool:
    """Back to pending, due now, its message enqueued with it, and a fresh send budget."""
    if effect.state != from_state:
        return False
    return _operator_move(
        effect,
        operator,
        action,
        enqueue=True,
        note=note,
        state=State.PENDING,
        reason="",
        next_attempt_at=Now(),
        lease_expires_at=None,
        max_attempts=effect.attempts + conf.effect_max_attempts(),
    )


def recheck_withheld(effect: Effect, *, operator: str, note: str = "") -> bool:
    """Operator: a worker rechecks a withheld effect's recipient and releases it if allowed."""
    return _resend(effect, operator, EffectEvent.Action.RECHECK, State.WITHHELD, note)


def send_again(effect: Effect, *, operator: str, note: str = "") -> bool:
    """Operator: a worker sends a needs_review effect once more (same key; e-mail may repeat)."""
    return _resend(effect, operator, EffectEvent.Action.SEND_AGAIN, State.NEEDS_REVIEW, note)


def mark_sent(effect: Effect, *, operator: str, note: str = "") -> bool:
    """Operator: a needs_review effect is known to have arrived (checked out of band)."""
    if effect.state != State.NEEDS_REVIEW:
        return False
    return _operator_move(
        effect,
        operator,
        EffectEvent.Action.MARK_SENT,
        enqueue=False,
        note=note,
        state=State.APPLIED,
        applied_at=Now(),
        provider_ref=effect.provider_ref or "marked-sent",
        reason=f"marked sent by operator {operator}"[:300],
        lease_expires_at=None,
    )


def redrive(effect: Effect, *, operator: str, note: str = "") -> bool:
    """Operator (a redrive of a group, ``jobs.ops.redrive``): a failed or needs_review
    effect back to pending under the same key, due through the ledger's own claim."""
    if effect.state not in rules.REDRIVE_SOURCES["effect"]:
        return False
    return _resend(effect, operator, EffectEvent.Action.SEND_AGAIN, effect.state, note)


def found_by_operator(effect: Effect, *, operator: str, ref: str, note: str = "") -> bool:
    """Operator (a redrive): the provider's lookup says it applied the effect's key:
    recorded as applied with its reference, and nothing is sent."""
    if effect.state not in rules.REDRIVE_SOURCES["effect"]:
        return False
    return _operator_move(
        effect,
        operator,
        EffectEvent.Action.LOOKUP,
        enqueue=False,
        code="found",
        note=note,
        state=State.APPLIED,
        provider_ref=str(ref)[:200],
        applied_at=Now(),
        reason="",
        lease_expires_at=None,
        last_error_class="",
        last_error_code="",
    )
