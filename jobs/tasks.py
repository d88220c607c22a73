"""django-q2 entry points. Messages carry only ids: nothing private in the queue.

Each delivery runs inside ``supervisor.delivery``: it marks progress for
``manage.py jobs_worker`` and reports a failure that escaped the engine (e.g. the
database refused the claim) by class and code only; django-q2 records it and
redelivers the message.
"""

from __future__ import annotations

from jobs import backends, dispatch
from jobs.delivery import release, runner
from jobs.engine.job_machine import worker_identity
from jobs.models import Effect
from jobs.supervisor import delivery


def run_job(job_id: int, due: str | None = None) -> str:
    """One delivery of a job; returns after every outcome is committed (then django-q2 acks).

    ``due``: the due time a message sent ahead was held for (``jobs.bulk.
    enqueue_job_when_due``); the delivery does not need it, the supervisor reads it.
    """
    with delivery("run_job", job_id):
        # The message names a job and wakes its queue: the claim may take a better job of
        # that queue (docs/app/scheduling.md); the result names the job it ran.
        result = runner.run_delivery(job_id)
        # A django.tasks task that this delivery finished: task_finished, now it is committed.
        backends.announce_finished(result.job_id, result.outcome)
        return result.outcome


def release_effect(effect_pk: int) -> str:
    """Re-drive one effect (crash after publish, unknown outcome, temporary failure)."""
    with delivery("release_effect", effect_pk):
        effect = Effect.objects.select_related("job").filter(pk=effect_pk).first()
        if effect is None:
            return "missing"
        return release.release(effect, worker_identity())


def run_dispatcher() -> str:
    """The scheduled sweep (the fine-grained loop is ``manage.py jobs_dispatcher``)."""
    return " ".join(f"{k}={v}" for k, v in dispatch.dispatch_once().items())
