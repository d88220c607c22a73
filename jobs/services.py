"""The operator actions on jobs and effects, and the bookkeeping of their queue messages.

Jobs are asked for with ``jobs.request`` (``jobs.api``).

Enqueueing happens in the same transaction as the row it is for: with
django-q2's ORM broker on the same database, the job and its queue message
commit together or not at all.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from jobs import clock, conf, rules
from jobs.engine import effect_machine, job_machine
from jobs.models import Effect, Job
from jobs.queue import enqueue_effect, enqueue_job

__all__ = ["enqueue_effect", "enqueue_job"]


def needs_message(due_field: str) -> Q:
    """No message yet for this due time, or the last one is presumed lost.

    ``enqueued_for`` holds when the last message was sent. A message older than
    the re-drive window (the broker's redelivery time, twice) that left the job
    still due was lost or is stuck in a dead cluster: one more is sent. A spare
    message costs one duplicate delivery; a lost one would cost the job. Judged
    by the server's clock.
    """
    lost_before = clock.before(conf.redrive_after_seconds())
    return (
        Q(enqueued_for__isnull=True)
        | Q(enqueued_for__lt=F(due_field))
        | Q(enqueued_for__lt=lost_before)
    )


def _same_instant(field: str, at: datetime) -> Q:
    """``field`` holds the instant ``at`` read from it.

    SQLite keeps the server clock's values as text with milliseconds
    (``STRFTIME('%f')``) and Django compares with microseconds: the same instant
    is matched within a millisecond there (text compares in time order).
    """
    if connection.vendor != "sqlite":
        return Q(**{field: at})
    tick = timedelta(milliseconds=1)
    return Q(**{f"{field}__gt": at - tick, f"{field}__lt": at + tick})


def mark_enqueued(model, pk: int, due_field: str, due_at: datetime | None, states) -> bool:
    """Claim the right to enqueue ``pk`` now: one message per due time (and per lost one).

    The row is locked with SKIP LOCKED first: a row held by a worker's open
    transaction (even a frozen one) is passed over, never waited for; the next
    sweep tries again. ``due_at`` None: whatever the due time is now.
    """
    rows = model.objects.filter(pk=pk, state__in=states)
    if due_at is not None:
        rows = rows.filter(_same_instant(due_field, due_at))
    rows = rows.filter(needs_message(due_field))
    if not rows.select_for_update(skip_locked=True).values_list("pk", flat=True):
        return False
    return rows.update(enqueued_for=Now()) == 1


def _after_operator_change(job: Job) -> None:
    with transaction.atomic():
        if mark_enqueued(Job, job.pk, "next_attempt_at", None, [job.state]):
            enqueue_job(job)


def cancel_job(job: Job, *, operator: str = "") -> bool:
    """Operator: stop a job that has not started or is waiting to retry, or ask a running
    one to stop (it ends ``cancelled`` at its worker's next check and publishes nothing).

    Each of these arrows writes its history row (``JobEvent``, naming ``operator``)
    in the transaction of its compare-and-swap.
    """
    return job_machine.cancel(job, actor=_actor(operator))


def cancel_follow_ups(job: Job, *, operator: str = "") -> bool:
    """Operator: cancel the follow-ups a succeeded job requested that are not running (and
    theirs); its groups' joins will not run (docs/app/chains.md). Each cancel writes its
    history row naming ``operator``."""
    return job_machine.cancel_follow_ups(job, actor=_actor(operator)) > 0


def has_follow_ups_to_cancel(job: Job) -> bool:
    """Whether ``job`` requested follow-ups of which one is still waiting to run."""
    return Job.objects.filter(rules.to_q(rules.WAITING), parent=job).exists()


def requeue_job(job: Job, *, operator: str = "") -> bool:
    """Operator: give a failed or dead job a fresh attempt budget and enqueue it."""
    with transaction.atomic():
        if not job_machine.requeue(job, actor=_actor(operator)):
            return False
        _after_operator_change(job)
    return True


def retry_job_now(job: Job, *, operator: str = "") -> bool:
    """Operator: run a waiting job now instead of at its backoff time."""
    with transaction.atomic():
        if not job_machine.retry_now(job, actor=_actor(operator)):
            return False
        _after_operator_change(job)
    return True


def _actor(operator: str) -> str:
    return f"operator:{operator}" if operator else "operator"


def recheck_and_release(effect: Effect, *, operator: str) -> bool:
    """Operator: a worker rechecks a withheld effect's recipient and releases it if allowed.

    Returns at once: the row change and its message commit together.
    """
    return effect_machine.recheck_withheld(effect, operator=operator)
