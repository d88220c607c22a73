"""Be a worker for the queued effect messages, in this process (tests and drills).

A publish enqueues one ``jobs.tasks.release_effect`` message per external effect;
a qcluster would run them. Tests and the practice drill run them here instead,
on the real queue rows, deleting each (the acknowledgement) as django-q2 does.
"""

from __future__ import annotations

from django_q.models import OrmQ

from jobs.delivery.release import release
from jobs.engine.job_machine import worker_identity
from jobs.models import Effect


def run_queued_effects(worker: str | None = None) -> dict[int, str]:
    """Release every queued effect message as ``worker``; returns outcomes by effect pk."""
    worker = worker or worker_identity()
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
