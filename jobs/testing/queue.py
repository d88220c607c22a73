"""Be a worker for the queued effect releases, in this process (tests and drills).

A publish leaves each external effect due for release: on the message brokers with one
``jobs.tasks.release_effect`` message, on the claiming broker (``jobs.claiming``) as its
ledger row alone. A qcluster would release them; tests and the practice drill release
them here instead: the real queue rows, each deleted (the acknowledgement) as django-q2
does, or every effect the ledger holds due now, once each, in due order.
"""

from __future__ import annotations

from django.db.models.functions import Coalesce
from django_q.models import OrmQ

from jobs import queue, rules
from jobs.delivery.release import release
from jobs.engine.job_machine import worker_identity
from jobs.models import Effect


def run_queued_effects(worker: str | None = None) -> dict[int, str]:
    """Release every queued effect as ``worker``; returns outcomes by effect pk."""
    worker = worker or worker_identity()
    if queue.claims_jobs():
        return _release_due(worker)
    results = {}
    for message in OrmQ.objects.order_by("id"):
        task = message.task
        if task.get("func") != "jobs.tasks.release_effect":
            continue
        message.delete()  # acknowledged, as django-q2 does after the task returns
        (pk,) = task["args"]
        effect = Effect.objects.select_related("job").filter(pk=pk).first()
        results[pk] = "missing" if effect is None else release(effect, worker)
    return results


def _release_due(worker: str) -> dict[int, str]:
    due = Effect.objects.filter(rules.to_q(rules.EFFECT_RELEASABLE)).select_related("job")
    order = Coalesce("next_attempt_at", "lease_expires_at", "created_at")
    return {effect.pk: release(effect, worker) for effect in due.order_by(order, "pk")}
