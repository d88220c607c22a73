"""The operator actions on jobs and effects.

Jobs are asked for with ``jobs.request`` (``jobs.api``). Each action is a compare-and-swap
with its history row; the wake-up of the job's queue (a NOTIFY) commits with it.
"""

from __future__ import annotations

from django.db import transaction

from jobs import rules
from jobs.engine import effect_machine, job_machine
from jobs.models import Effect, Job
from jobs.queue import enqueue_effect, enqueue_job

__all__ = ["enqueue_effect", "enqueue_job"]


def _after_operator_change(job: Job) -> None:
    enqueue_job(job)  # its queue's clusters look at it when the operator's arrow commits


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
