"""The effect ledger: one row per business outcome, the only writer of ``Effect.state``.

An effect's identity (``job:revision:name:recipient``) and its idempotency key
are derived, never generated, so every retry, redelivery and re-drive names
the same effect and sends the same key. Rows are inserted in the publish
transaction; a worker that lost its lease publishes nothing, so it records
nothing either.

    pending ──claim_send──▶ sending ──▶ applied | withheld | failed | needs_review
                              │  └────▶ unknown (sent, no answer: retry, same key)
                              └───────▶ pending (temporary: retry later)
"""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from jobs import conf, registry
from jobs.models import Effect, Job
from jobs.registry import EffectSpec
from jobs.retry import ErrorClass, backoff_delay, classify

log = logging.getLogger("jobs.ledger")

State = Effect.State


def effect_identity(job: Job, name: str, recipient: str) -> str:
    """e.g. ``84:29:completion-notice:47``: the same outcome always has the same id."""
    return f"{job.pk}:{job.output_revision}:{name}:{recipient}"


def idempotency_key(effect_id: str) -> str:
    """Derived from the identity, so a retry can never mint a new key."""
    return "fx-" + hashlib.sha256(effect_id.encode()).hexdigest()[:40]


def record(job: Job, specs: list[EffectSpec]) -> list[Effect]:
    """Insert the pending effects; call inside the publish transaction."""
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
        rows.append(
            Effect(
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
        )
    return Effect.objects.bulk_create(rows)


def _cas(effect: Effect, *, owner: str | None = None, **changes) -> bool:
    now = changes.pop("now", None) or timezone.now()
    qs = Effect.objects.filter(pk=effect.pk, version=effect.version)
    if owner is not None:
        qs = qs.filter(lease_owner=owner)
    won = qs.update(version=F("version") + 1, updated_at=now, **changes) == 1
    if won:
        effect.version += 1
        effect.updated_at = now
        for name, value in changes.items():
            if not hasattr(value, "resolve_expression"):
                setattr(effect, name, value)
    return won


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


def release(effect: Effect, worker: str, *, own_publish: bool = False) -> str:
    """Recheck authorization and deliver one effect; returns the state it ended in."""
    if not claim_send(effect, worker, own_publish=own_publish):
        return "skipped"
    reason = withhold_reason(effect)
    if reason:
        _cas(
            effect,
            owner=worker,
            state=State.WITHHELD,
            reason=reason[:300],
            lease_expires_at=None,
            last_error_class=ErrorClass.AUTHORIZATION,
            last_error_code="recipient_not_authorized",
        )
        _log(effect, "withheld", worker)
        return State.WITHHELD

    provider = registry.get_provider(effect.provider)
    try:
        if provider.transactional:
            with transaction.atomic():
                ref = provider.apply(effect)
                if not _applied(effect, worker, ref):
                    raise _LostSend
        else:
            ref = provider.send(effect)
            if not _applied(effect, worker, ref):
                # Another sender took over after our lease ran out; the provider
                # deduplicates by key, and the ledger keeps the first outcome.
                _log(effect, "lease_lost", worker)
                return "lease_lost"
    except _LostSend:
        _log(effect, "lease_lost", worker)
        return "lease_lost"
    except Exception as exc:  # the retry table decides, not this except
        return _record_failure(effect, worker, provider, exc)
    _log(effect, "applied", worker, ref=effect.provider_ref)
    return State.APPLIED


def _applied(effect: Effect, worker: str, ref: str) -> bool:
    now = timezone.now()
    return _cas(
        effect,
        owner=worker,
        state=State.APPLIED,
        provider_ref=str(ref)[:200],
        applied_at=now,
        lease_expires_at=None,
        last_error_class="",
        last_error_code="",
        now=now,
    )


def _record_failure(effect: Effect, worker: str, provider, exc: BaseException) -> str:
    c = classify(exc)
    now = timezone.now()
    out_of_budget = effect.attempts >= int(conf.get("JOBS_EFFECT_MAX_ATTEMPTS"))
    if c.error_class == ErrorClass.VALIDATION:
        state, reason = State.FAILED, "provider rejected the notice as invalid"
    elif c.error_class == ErrorClass.AUTHORIZATION:
        state, reason = State.NEEDS_REVIEW, "provider refused our credentials"
    elif c.error_class == ErrorClass.PROVIDER_TIMEOUT and not provider.supports_idempotency:
        state, reason = State.NEEDS_REVIEW, "sent without an answer; provider cannot deduplicate"
    elif out_of_budget:
        state, reason = State.NEEDS_REVIEW, "send attempts exhausted"
    elif c.error_class == ErrorClass.PROVIDER_TIMEOUT:
        state, reason = State.UNKNOWN, "sent without an answer; will retry with the same key"
    else:
        state, reason = State.PENDING, ""
    changes = {"state": state, "reason": reason, "lease_expires_at": None}
    if state in (State.PENDING, State.UNKNOWN):
        delay = backoff_delay(
            effect.attempts,
            floor=float(conf.get("JOBS_BACKOFF_FLOOR_SECONDS")),
            base=float(conf.get("JOBS_BACKOFF_BASE_SECONDS")),
            cap=float(conf.get("JOBS_BACKOFF_CAP_SECONDS")),
            retry_after=c.retry_after,
        )
        changes["next_attempt_at"] = now + timedelta(seconds=delay)
    _cas(
        effect,
        owner=worker,
        last_error_class=c.error_class,
        last_error_code=c.code,
        now=now,
        **changes,
    )
    _log(effect, state, worker, error_class=c.error_class, code=c.code)
    return state


def release_for_job(job: Job, worker: str) -> dict[str, str]:
    """Release every pending effect this worker just published."""
    results = {}
    for effect in Effect.objects.filter(job=job, state=State.PENDING).select_related("job"):
        results[effect.effect_id] = release(effect, worker, own_publish=True)
    return results


def recheck_withheld(effect: Effect) -> bool:
    """Operator: put a withheld effect back to pending so release rechecks policy."""
    if effect.state != State.WITHHELD:
        return False
    return _cas(
        effect, state=State.PENDING, reason="", next_attempt_at=timezone.now(), enqueued_for=None
    )
