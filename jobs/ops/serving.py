"""Which queues no worker serves, asked by one job's page (``Retry now`` in such a queue
runs nothing): the console's own rule (``jobs.ops.verdict``), for one queue."""

from __future__ import annotations

from django.utils import timezone

from jobs.ops.verdict import Snapshot, queue_reasons, queues


def queue_unserved(name: str) -> str:
    """The command that serves queue ``name`` when the console flags it as served by no
    worker now (the same rule as its health line), else ""."""
    found = [q for q in queues() if q.name == name]
    snap = Snapshot(
        now=timezone.now(),
        jobs=[],
        effects=[],
        queue_depth=0,
        queue_taken=0,
        oldest_due_at=None,
        workers=[],
        retries_due=[],
        retries_due_count=0,
        effect_retries_due_count=0,
        needs_review=[],
        needs_review_count=0,
        queues=found,
    )
    reasons = queue_reasons(snap)
    return reasons[0].command if reasons else ""
