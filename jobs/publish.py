"""The publish: one immutable plan, carried out by one of two executors.

``build`` turns a finished handler's output into a ``Plan`` once: the owner fence,
the job's columns, the attempt's outcome, the artifact row, the effect rows
already decided (in-app notices applied or withheld, the rest pending), the
notices and events that commit with them, the accounts the release rule must
still admit, and which effects need a queue message or a provider's own code.

``carry_out`` gives the plan to the PostgreSQL executor (``jobs.sql.publish``: one
statement in autocommit) when it can take it, else to the ORM executor here (one
worker transaction; SQLite, psycopg2, queue messages, other transactional
providers, a job row locked elsewhere). Both write the same rows; the parity test
(``tests/jobs/test_publish_parity.py``) runs both and compares every one.

If the release rule refuses an account at the moment of the publish, nothing is
written and the caller builds the plan again with that recipient withheld: the
rule is checked in the same statement or transaction that commits the notice.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth import get_user_model
from django.db import DatabaseError, connection, transaction

from jobs import clock, conf, ledger, queue, registry, rules, sql, transitions
from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, Notice
from jobs.providers.inapp import InAppProvider

log = logging.getLogger("jobs.publish")

State = Effect.State


@dataclass(frozen=True)
class Plan:
    """Everything one publish writes, decided before anything is written."""

    job: Job
    worker: str
    attempt: Attempt
    margin: float  # seconds of lease that must be left when the fence is checked
    changes: tuple[tuple[str, Any], ...]  # the job's columns (``transitions.publish_changes``)
    artifact: Artifact | None
    effects: tuple[Effect, ...]  # unsaved, in their born state
    notices: tuple[tuple[str, Notice], ...]  # (effect_id, unsaved in-app notice)
    events: tuple[tuple[str, EffectEvent], ...]  # (effect_id, unsaved event)
    accounts: tuple[str, ...]  # recipients of applied notices: the release rule checks them
    applies: tuple[str, ...]  # effect_ids a transactional provider applies (its own code)
    enqueues: tuple[str, ...]  # effect_ids that leave with a queue message

    def statement_refusal(self) -> str:
        """Why the one-statement executor cannot take this plan ("" if it can)."""
        if self.enqueues:
            return "effects that need a queue message"
        if self.applies:
            return "a transactional provider's own apply"
        return ""


class Status(enum.Enum):
    WON = "won"  # the job is succeeded; everything in the plan committed with it
    LOST = "lost"  # the fence failed: another worker owns the job; nothing was written
    ACCOUNTS_REFUSED = "accounts_refused"  # nothing written: build again without them


@dataclass
class Result:
    status: Status
    executor: str
    refused: dict[str, str] = field(default_factory=dict)  # recipient → withhold reason
    effects: list[Effect] = field(default_factory=list)


def build(
    job: Job,
    worker: str,
    attempt: Attempt,
    artifact: Artifact | None,
    specs: list,
    *,
    refused: Mapping[str, str] | None = None,
) -> Plan:
    """The plan of one publish. ``refused``: recipients the release rule refused at
    an earlier try (withheld now, with the rule's reason)."""
    rows = ledger.prepare(job, specs, refused=refused or {})
    notices, events, accounts, applies, enqueues = [], [], [], [], []
    for effect in rows:
        provider = registry.get_provider(effect.provider)
        if effect.state == State.WITHHELD:
            events.append((effect.effect_id, ledger.withhold_event(effect, worker)))
        elif effect.state == State.PENDING and effect.version:  # the release check raised
            events.append((effect.effect_id, ledger.check_failed_event(effect, worker)))
            enqueues.append(effect.effect_id)
        elif effect.state == State.PENDING:
            enqueues.append(effect.effect_id)
        elif type(provider) is InAppProvider:  # its notice row is part of the plan
            try:
                notice = provider.notice_for(effect)
            except Exception as exc:  # the retry table decides, as for a failed apply
                events.append((effect.effect_id, ledger.apply_failed(effect, worker, exc)))
                enqueues.append(effect.effect_id)
                continue
            notices.append((effect.effect_id, notice))
            events.append((effect.effect_id, ledger.send_event(effect, worker)))
            accounts.append(effect.recipient)
        else:  # another transactional provider (or a subclass with its own apply): its
            # apply runs in the ORM transaction
            applies.append(effect.effect_id)
            accounts.append(effect.recipient)
    return Plan(
        job=job,
        worker=worker,
        attempt=attempt,
        margin=conf.transaction_idle_seconds(),
        changes=tuple(transitions.publish_changes().items()),
        artifact=artifact,
        effects=tuple(rows),
        notices=tuple(notices),
        events=tuple(events),
        accounts=tuple(dict.fromkeys(accounts)),
        applies=tuple(applies),
        enqueues=tuple(enqueues),
    )


def carry_out(plan: Plan, *, executor: str | None = None) -> Result:
    """Write the plan with the one-statement executor if it can, else the ORM's.

    ``executor`` ("statement" or "orm") forces one (the parity test); a plan the
    statement cannot take always goes to the ORM executor.
    """
    if executor != "orm" and sql.available() and not plan.statement_refusal():
        try:
            with transaction.atomic() if connection.in_atomic_block else nullcontext():
                result = sql.publish(plan)
        except DatabaseError as exc:
            why = sql.refusal(exc)
            if why is None:
                raise  # a lost connection is an error, not a refusal
            log.info("job=%s one-statement publish gave way (%s): ORM path", plan.job.pk, why)
        else:
            if result.status == Status.WON:
                _mirror(plan)
                ledger.log_born(plan.effects, plan.worker)
                result.effects = list(plan.effects)
            return result
    return _orm(plan)


def _mirror(plan: Plan) -> None:
    """The instances as the committed rows left them (the statement returned the ids)."""
    transitions.mirror_publish(plan.job, plan.worker)
    plan.attempt.outcome = Attempt.Outcome.SUCCEEDED


def refused_accounts(accounts: tuple[str, ...]) -> dict[str, str]:
    """The recipients the account rule refuses now, with the reason (ORM executor)."""
    if not accounts:
        return {}
    user = get_user_model()
    found = {
        str(pk): ok
        for pk, ok in user._default_manager.filter(pk__in=accounts)
        .annotate(admitted=rules.admitted(user))
        .values_list("pk", "admitted")
    }
    refused = {}
    for recipient in accounts:
        ok = found.get(recipient)
        if ok is None:
            refused[recipient] = ledger.ACCOUNT_MISSING
        elif not ok:
            refused[recipient] = ledger.ACCOUNT_REFUSED
    return refused


def _orm(plan: Plan) -> Result:
    job, worker = plan.job, plan.worker
    with clock.worker_transaction():
        refused = refused_accounts(plan.accounts)
        if refused:
            return Result(Status.ACCOUNTS_REFUSED, "orm", refused)
        if not transitions.publish(job, worker, margin=plan.margin):
            return Result(Status.LOST, "orm")
        transitions.finish_attempt(plan.attempt, Attempt.Outcome.SUCCEEDED)
        if plan.artifact is not None:
            plan.artifact.save(force_insert=True)
        failed_applies = insert_effects(plan)
        # External sends leave this task: each gets its own message, committed with
        # the publish, so a slow provider never holds the job's delivery open.
        for effect in plan.effects:
            if effect.effect_id in plan.enqueues:
                queue.enqueue_effect(effect)
        for effect in failed_applies:
            queue.enqueue_effect(effect)
    ledger.log_born(plan.effects, worker)
    return Result(Status.WON, "orm", effects=list(plan.effects))


def insert_effects(plan: Plan) -> list[Effect]:
    """The effect rows, their notices and events, and the other providers' applies.

    Returns the effects whose apply failed (back to pending: they need a message).
    """
    if not plan.effects:
        return []
    Effect.objects.bulk_create(plan.effects)
    by_id = {e.effect_id: e for e in plan.effects}
    notices = []
    for effect_id, notice in plan.notices:
        notice.effect = by_id[effect_id]
        notices.append(notice)
    Notice.objects.bulk_create(notices)
    for notice in notices:
        notice.effect.provider_ref = rules.notice_reference(notice.pk)
    if notices:
        Effect.objects.bulk_update([n.effect for n in notices], ["provider_ref"])
    events = []
    for effect_id, event in plan.events:
        event.effect = by_id[effect_id]
        events.append(event)
    applied = [by_id[i] for i in plan.applies]
    events += ledger.apply_in_publish(applied, plan.worker)
    EffectEvent.objects.bulk_create(events)
    # An apply that failed went back to pending: it leaves with a message too.
    return [e for e in applied if e.state == State.PENDING]
