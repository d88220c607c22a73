"""The publish in Django's ORM: the whole arrow on every database.

It carries out a frozen ``Plan`` in one worker transaction (its lock timeout bounds
every wait): the account rule for the plan's recipients, the owner-fenced swap to
``succeeded``, the group writes, the attempt's outcome, the artifact row, the effects
born in their first state with their notices and events, and a wake for each effect
that leaves with a worker. The ORM executor is this; the PostgreSQL executor's one
statement is its fast form and gives way to it for the refusals it documents.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model

from jobs import clock, queue, rules
from jobs.engine import effect_machine, groups, job_machine
from jobs.engine.plan import Plan, Result, Status
from jobs.models import Attempt, Effect, EffectEvent, JobStep, Notice

State = Effect.State
# The executor a result names: this publish is the ORM executor's.
EXECUTOR = "orm"


def refused_accounts(accounts: tuple[str, ...]) -> dict[str, str]:
    """The recipients the account rule refuses now, with the reason."""
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
            refused[recipient] = rules.ACCOUNT_MISSING
        elif not ok:
            refused[recipient] = rules.ACCOUNT_REFUSED
    return refused


def write_steps(rows) -> None:
    """Insert durable steps' finished rows; call inside the transaction of a fenced write
    that won (``jobs.delivery.steps``: a step with a row of its own is never among them,
    so a conflict can only be a row that already stands for the step)."""
    if rows:
        JobStep.objects.bulk_create(list(rows), ignore_conflicts=True)


def publish(plan: Plan) -> Result:
    """Carry out ``plan`` in one worker transaction (its lock timeout bounds every wait)."""
    job, worker = plan.job, plan.worker
    with clock.worker_transaction():
        refused = refused_accounts(plan.accounts)
        if refused:
            return Result(Status.ACCOUNTS_REFUSED, EXECUTOR, refused)
        if not job_machine.publish(job, worker, margin=plan.margin, changes=dict(plan.changes)):
            return Result(Status.LOST, EXECUTOR)
        groups.write(plan.follow_ups, plan.groups)
        write_steps(plan.steps)
        job_machine.finish_attempt(plan.attempt, Attempt.Outcome.SUCCEEDED)
        if plan.artifact is not None:
            plan.artifact.save(force_insert=True)
        failed_applies = _insert_effects(plan)
        # External sends leave this task: the ledger rows are their queue entries, and
        # the clusters are woken when this commits, so a slow provider never holds the
        # job's delivery open.
        for effect in plan.effects:
            if effect.effect_id in plan.enqueues:
                queue.enqueue_effect(effect)
                break
        else:
            if failed_applies:
                queue.enqueue_effect(failed_applies[0])
    effect_machine.log_born(plan.effects, worker)
    return Result(Status.WON, EXECUTOR, effects=list(plan.effects))


def _insert_effects(plan: Plan) -> list[Effect]:
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
    events += effect_machine.apply_in_publish(applied, plan.worker)
    EffectEvent.objects.bulk_create(events)
    # An apply that failed went back to pending: it leaves with a message too.
    return [e for e in applied if e.state == State.PENDING]
