"""The publish: one immutable plan, built once, carried out by this process's executor.

``build`` turns a finished handler's output into a ``Plan`` once: the owner fence,
the job's columns, the attempt's outcome, the artifact row, the effect rows
already decided (in-app notices applied or withheld, the rest pending), the
notices and events that commit with them, the accounts the release rule must
still admit, and which effects need a queue message or a provider's own code.

``carry_out`` gives the plan to the executor (``jobs.executors``): one statement on
PostgreSQL, one worker transaction elsewhere. Both write the same rows; the contract
test (``tests/jobs/test_executor_contract.py``) runs both and compares every one.

If the release rule refuses an account at the moment of the publish, nothing is
written and the caller builds the plan again with that recipient withheld: the
rule is checked in the same statement or transaction that commits the notice.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from django.db.models.functions import Now
from django.utils import timezone

from jobs import conf, executors, registry
from jobs.delivery import policy
from jobs.engine import effect_machine, groups, job_machine
from jobs.engine.plan import Plan, Result, Status
from jobs.models import Artifact, Attempt, Effect, Job, JobStep
from jobs.registry import EffectSpec
from jobs.retry import ErrorClass, classify

__all__ = ["Plan", "Result", "Status", "build", "carry_out"]

log = logging.getLogger("jobs.publish")

State = Effect.State


def build(
    job: Job,
    worker: str,
    attempt: Attempt,
    artifact: Artifact | None,
    output: registry.Output,
    *,
    refused: Mapping[str, str] | None = None,
    progress: tuple[int, int | None, str] | None = None,
    steps: tuple[JobStep, ...] = (),
) -> Plan:
    """The plan of one publish. ``refused``: recipients the release rule refused at
    an earlier try (withheld now, with the rule's reason); ``progress``: the handler's
    progress not yet written (``ctx.progress`` keeps a second's calls), written with it;
    ``steps``: the durable steps this attempt finished and has not recorded yet."""
    rows = prepare(job, output.effects, refused=refused or {})
    # A column already at its published value is left out (a first attempt has no error
    # to clear): the usual publish's statement is shorter, within psycopg's parse cache.
    changes = {
        name: value
        for name, value in job_machine.publish_changes().items()
        if isinstance(value, Now) or getattr(job, name) != value
    }
    if progress is not None:
        done, total, note = progress
        changes.update(
            progress_done=done, progress_total=total, progress_note=note, progress_at=Now()
        )
    if output.has_result:
        changes["result"] = output.result
    follow_ups, groups_ = groups.rows_for(job, output)
    notices, events, accounts, applies, enqueues = [], [], [], [], []
    for effect in rows:
        provider = registry.get_provider(effect.provider)
        if effect.state == State.WITHHELD:
            events.append((effect.effect_id, effect_machine.withhold_event(effect, worker)))
        elif effect.state == State.PENDING and effect.version:  # the release check raised
            events.append((effect.effect_id, effect_machine.check_failed_event(effect, worker)))
            enqueues.append(effect.effect_id)
        elif effect.state == State.PENDING:
            enqueues.append(effect.effect_id)
        elif provider.notice_in_plan:  # its notice row is part of the plan
            try:
                notice = provider.notice_for(effect)
            except Exception as exc:  # the retry table decides, as for a failed apply
                events.append((effect.effect_id, effect_machine.apply_failed(effect, worker, exc)))
                enqueues.append(effect.effect_id)
                continue
            notices.append((effect.effect_id, notice))
            events.append((effect.effect_id, effect_machine.send_event(effect, worker)))
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
        changes=tuple(changes.items()),
        artifact=artifact,
        effects=tuple(rows),
        notices=tuple(notices),
        events=tuple(events),
        accounts=tuple(dict.fromkeys(accounts)),
        applies=tuple(applies),
        enqueues=tuple(enqueues),
        follow_ups=tuple(follow_ups),
        groups=tuple((group, tuple(children)) for group, children in groups_),
        steps=steps,
    )


def carry_out(plan: Plan, *, executor: str | None = None) -> Result:
    """Write the plan with this process's executor (``executor`` forces one: the
    contract test runs each)."""
    chosen = executors.current() if executor is None else executors.by_name(executor)
    return chosen.publish(plan)


def prepare(job: Job, specs: list[EffectSpec], *, refused: Mapping[str, str]) -> list[Effect]:
    """The job's effect rows, unsaved; transactional ones already decided.

    Effects of a transactional provider (the in-app notice) are released in the
    publish: the kind's own check (``authorize_release``) runs here, right before
    it, and the row is born ``applied`` (or ``withheld``); the account rule
    (``jobs.rules.account_admits``) is checked by the executor in the statement or
    transaction that commits it (``jobs.executors``). ``refused``: recipients that rule
    refused at an earlier try, withheld with its reason. The other effects are born
    ``pending``, due now and marked enqueued: the publish enqueues their messages.
    """
    now = timezone.now()  # shown to people only; due times below use the server's clock
    budget = conf.effect_max_attempts()
    rows = []
    seen = set()
    for spec in specs:
        effect_id = effect_machine.effect_identity(job, spec.name, str(spec.recipient))
        if effect_id in seen:  # the same outcome asked for twice is still one outcome
            continue
        seen.add(effect_id)
        effect = Effect(
            effect_id=effect_id,
            job=job,
            name=spec.name,
            provider=spec.provider,
            recipient=str(spec.recipient),
            idempotency_key=effect_machine.idempotency_key(effect_id),
            data=spec.data,
            max_attempts=budget,
            next_attempt_at=Now(),
            created_at=now,
            updated_at=now,
        )
        if registry.get_provider(spec.provider).transactional:
            reason = refused.get(effect.recipient)
            _decide_in_publish(effect, now, (lambda e, r=reason: r) if reason else None)
        rows.append(effect)
    return rows


def _decide_in_publish(effect: Effect, now, check=None) -> None:
    """Run the kind's release check (or ``check``) now: the row is born applied or withheld.

    If the check itself fails, the row goes in ``pending`` at version 1 with the
    failure recorded (one attempt spent), and the ordinary release path retries
    it by the table: a failing policy check never undoes the job's publish.
    """
    effect.attempts = 1
    try:
        reason = (check or policy.kind_release_check)(effect)
    except Exception as exc:  # the retry table decides, in release
        c = classify(exc)
        effect.version = 1
        effect.last_error_class, effect.last_error_code = c.error_class, c.code
        return
    if reason:
        effect.next_attempt_at = None  # final: nothing is due
        effect.state = State.WITHHELD
        effect.reason = reason[:300]
        effect.last_error_class = ErrorClass.AUTHORIZATION
        effect.last_error_code = "recipient_not_authorized"
    else:
        effect.next_attempt_at = None
        effect.state = State.APPLIED
        effect.applied_at = now
