"""Follow-up work: chains, groups and their one join (docs/app/chains.md).

A handler's ``jobs.then`` and ``jobs.group`` become rows here (``rows_for``) and are
written by the publish that makes their parent succeeded (``write``), in its
transaction: a parent whose publish lost its fence requested nothing.

Every end of a group's child (its publish, a failure, a spent budget, a cancel) calls
``child_ended`` in that end's own transaction: a compare-and-swap on the child's
``group_outcome`` counts it once, one on the group's ``version`` bumps ``ended``, and
the swap that makes ``ended == size`` requests the join in that same transaction, so
the join exists exactly once, when the last child ended, and no process polls for it.
``sweep`` is the dispatcher's backstop for an end written elsewhere (an operator's
edit): it counts by the same swaps. The join is born by its kind's rule for a child
that did not succeed (``JobGroup.Rule``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models.functions import Now
from django.utils import timezone

from jobs import conf, queue, registry
from jobs.exceptions import JobError
from jobs.models import Job, JobGroup
from jobs.registry import FollowUp, Output

log = logging.getLogger("jobs.groups")

State = Job.State
Rule = JobGroup.Rule

# The subject of a follow-up: its parent job and its name (the job identity's subject).
FOLLOW_UP_SUBJECT = "jobs.job"
JOIN_SUBJECT = "jobs.group"
SWEEP_BATCH = 200


@dataclass(frozen=True)
class JoinedChild:
    """One child of the group a join job joins, as the join reads it (``ctx.joined()``)."""

    name: str
    job_id: int
    kind: str
    state: str  # succeeded, failed, dead or cancelled
    result: Any  # its ``jobs.result`` (None unless it succeeded with one)


def rows_for(job: Job, output: Output) -> tuple[list[Job], list[tuple[JobGroup, list[Job]]]]:
    """The follow-up rows of ``job``'s publish, unsaved: plain follow-ups, and each group
    with its children (the join's request resolved now, from its kind)."""
    follow_ups = [_child_row(job, spec, spec.name) for spec in output.follow_ups]
    groups = []
    for spec in output.groups:
        join_kind = registry.get_kind(spec.join.kind)
        group = JobGroup(
            parent=job,
            name=spec.name,
            size=len(spec.children),
            rule=join_kind.on_child_failure,
            join_kind=join_kind.name,
            join_params=dict(spec.join.params),
            join_priority=_priority(spec.join, join_kind),
            join_queue=spec.join.queue or join_kind.queue,
            join_max_attempts=join_kind.max_attempts or conf.max_attempts(),
            tenant_key=job.tenant_key,
        )
        children = [_child_row(job, c, f"{spec.name}.{c.name}") for c in spec.children]
        groups.append((group, children))
    return follow_ups, groups


def _priority(spec: FollowUp, kind: registry.JobKind) -> int:
    return kind.priority if spec.priority is None else spec.priority


def _child_row(parent: Job, spec: FollowUp, name: str) -> Job:
    kind = registry.get_kind(spec.kind)
    now = timezone.now()  # shown to people; due times are the server's clock
    return Job(
        kind=kind.name,
        subject_type=FOLLOW_UP_SUBJECT,
        subject_id=f"{parent.pk}.{name}",
        output_revision=1,
        tenant_key=parent.tenant_key,
        params=dict(spec.params),
        max_attempts=kind.max_attempts or conf.max_attempts(),
        priority=_priority(spec, kind),
        queue=spec.queue or kind.queue,
        parent=parent,
        next_attempt_at=Now(),
        created_at=now,
        updated_at=now,
    )


def write(follow_ups: tuple[Job, ...], groups: tuple[tuple[JobGroup, tuple[Job, ...]], ...]):
    """Insert the follow-ups and groups of a publish that won, with their messages; call
    inside the publish's transaction (the ORM executor's)."""
    rows = list(follow_ups)
    for group, children in groups:
        group.save(force_insert=True)
        for child in children:
            child.group = group
        rows += children
    if not rows:
        return
    Job.objects.bulk_create(rows)
    for row in rows:
        queue.enqueue_job(row)
    log.info(
        "job=%s requested %d follow-up(s) in %d group(s)",
        rows[0].parent_id,
        len(rows),
        len(groups),
    )


def child_ended(job: Job, outcome: str) -> bool:
    """Count ``job``'s end in its group, once; the last child's end requests the join.

    Call in the transaction of the arrow that ended it (or after, from ``sweep``): the
    count and that arrow commit together. False when ``job`` is in no group or was
    counted already (its first end counts; a requeued child's later end does not).
    """
    if job.group_id is None:
        return False
    with transaction.atomic():
        counted = Job.objects.filter(pk=job.pk, group_id=job.group_id, group_outcome="")
        if not counted.update(group_outcome=outcome):
            return False
        job.group_outcome = outcome
        while True:  # a CAS on the group's version; a loser reads again and retries
            group = JobGroup.objects.get(pk=job.group_id)
            ended = group.ended + 1
            not_succeeded = group.not_succeeded + (outcome != State.SUCCEEDED)
            swapped = JobGroup.objects.filter(pk=group.pk, version=group.version).update(
                ended=ended, not_succeeded=not_succeeded, version=group.version + 1
            )
            if swapped:
                break
        if ended == group.size:
            group.ended, group.not_succeeded = ended, not_succeeded
            _request_join(group)
    return True


def _request_join(group: JobGroup) -> Job:
    """The group's one join, by its rule: queued and enqueued, or born failed or cancelled
    (it never runs) when a child did not succeed and the rule says so."""
    rule = Rule.RUN if group.not_succeeded == 0 else group.rule
    if group.cancelled_at is not None and group.not_succeeded:
        rule = Rule.SKIP  # its parent was cancelled: the join does not run either
    now = timezone.now()
    fields: dict[str, Any] = {
        "tenant_key": group.tenant_key,
        "params": group.join_params,
        "max_attempts": group.join_max_attempts,
        "priority": group.join_priority,
        "queue": group.join_queue,
        "parent_id": group.parent_id,
        "created_at": now,
        "updated_at": now,
    }
    if rule == Rule.RUN:
        fields.update(next_attempt_at=Now())
    else:
        detail = _not_succeeded_detail(group)
        fields.update(
            state=State.FAILED if rule == Rule.FAIL else State.CANCELLED,
            finished_at=Now(),
            last_error_code="children_failed",
            last_error_detail=detail,
        )
    join, created = Job.objects.get_or_create(
        kind=group.join_kind,
        subject_type=JOIN_SUBJECT,
        subject_id=str(group.pk),
        output_revision=1,
        defaults=fields,
    )
    if created and rule == Rule.RUN:
        queue.enqueue_job(join)
    JobGroup.objects.filter(pk=group.pk, join__isnull=True).update(join=join, joined_at=Now())
    log.info(
        "group=%s parent=%s join=%s kind=%s %s (%d of %d children did not succeed; rule %s)",
        group.pk,
        group.parent_id,
        join.pk,
        join.kind,
        "requested" if rule == Rule.RUN else f"born {join.state}",
        group.not_succeeded,
        group.size,
        group.rule,
    )
    return join


def _not_succeeded_detail(group: JobGroup) -> str:
    """Which children did not succeed, by name and state (names are the developer's)."""
    missed = (
        Job.objects.filter(group=group)
        .exclude(group_outcome=State.SUCCEEDED)
        .order_by("pk")
        .values_list("subject_id", "group_outcome")[:5]
    )
    shown = ", ".join(f"{_name(s)} {o}" for s, o in missed)
    more = "" if group.not_succeeded <= 5 else ", ..."
    verb = {Rule.FAIL: "fails", Rule.SKIP: "skips"}.get(group.rule, "runs")
    text = (
        f"{group.not_succeeded} of {group.size} children did not succeed ({shown}{more}); "
        f"the join kind {verb} its join then"
    )
    if group.cancelled_at is not None:
        text = f"the parent job was cancelled; {text}"
    return text[:300]


def _name(subject_id: str) -> str:
    return subject_id.rsplit(".", 1)[-1]


def follow_up_name(job: Job) -> str:
    """A follow-up's name as its parent listed it: ``<name>``, ``<group>.<child>``, or
    ``join`` for a group's join (its subject is the group, not a name)."""
    if job.subject_type == JOIN_SUBJECT:
        return "join"
    return job.subject_id.split(".", 1)[-1]


def joined(job: Job) -> list[JoinedChild]:
    """The children of the group ``job`` joins, in the order the parent listed them."""
    group = JobGroup.objects.filter(join=job).first()
    if group is None:
        raise JobError(f"job {job.pk} is not the join of a group: ctx.joined() has nothing")
    children = Job.objects.filter(group=group).order_by("pk")
    return [
        JoinedChild(
            name=_name(child.subject_id),
            job_id=child.pk,
            kind=child.kind,
            state=child.group_outcome or child.state,
            result=child.result if child.group_outcome == State.SUCCEEDED else None,
        )
        for child in children.only("pk", "subject_id", "kind", "state", "group_outcome", "result")
    ]


def sweep(limit: int = SWEEP_BATCH) -> int:
    """Count ended children no arrow counted (an end written outside the engine); returns
    how many it counted. Each end still counts once: the same swaps decide."""
    ended = Job.objects.filter(group__isnull=False, group_outcome="", state__in=Job.TERMINAL).only(
        "pk", "group_id", "state"
    )[:limit]
    counted = 0
    for job in ended:
        counted += child_ended(job, job.state)
    if counted:
        log.warning("counted %d group child end(s) no arrow had counted", counted)
    return counted
