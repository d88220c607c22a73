"""The jobs a paused scope holds (``Job.held_by``): out of the claim's way until resumed.

A pause (``jobs.flow.set_rule``) holds the scope's waiting jobs in one update; a job
asked for later is held by the first claim that meets it (the admission's verdict:
paused, ``job_machine.defer``). A resume or a deleted rule releases them: their due
times were kept, so they take their old places in the queue. Held jobs are outside the
claim's partial indexes (migration 0022), so no claim reads a paused backlog.
"""

from __future__ import annotations

from jobs import queue, rules
from jobs.models import Job

# The job column a scope's prefix names: the jobs a paused scope holds.
_HELD_COLUMN = {
    rules.FLOW_KIND_PREFIX: "kind",
    rules.FLOW_TENANT_PREFIX: "tenant_key",
    rules.FLOW_QUEUE_PREFIX: "queue",
}


def hold(scope: str) -> int:
    """Hold the waiting jobs of a paused ``scope`` (``Job.held_by``): out of the claim's
    indexes, so no claim reads them until the scope is resumed. Jobs asked for later are
    held by the first claim that meets them (its verdict: paused). Returns how many."""
    for prefix, column in _HELD_COLUMN.items():
        if scope.startswith(prefix):
            waiting = Job.objects.filter(rules.to_q(rules.WAITING), held_by="")
            waiting = waiting.filter(**{column: scope[len(prefix) :]})
            # Rows a claim holds are passed over, never waited for (the claim may hold
            # one while it waits for this rule's row, locked here: a circle). Its verdict
            # reads the rule again once this commits and holds the job itself.
            free = waiting.select_for_update(skip_locked=True).values("pk")
            return Job.objects.filter(pk__in=free).update(held_by=scope[:200])
    return 0  # a provider's scope holds effects at their send, not jobs


def release(scope: str) -> int:
    """Give the jobs ``scope`` held back to their queues, in their old places (their due
    times were kept), and wake the clusters serving them when this commits. A job another
    paused scope also covers is held again by its next claim. Returns how many."""
    rows = Job.objects.filter(held_by=scope[:200])
    queues = sorted(set(rows.values_list("queue", flat=True)))
    released = rows.update(held_by="")
    if released:
        queue.notify_queues(queues)
    return released
