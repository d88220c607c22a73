"""Be a worker for the due effect releases, in this process (tests and drills).

A publish leaves each external effect due for release as its ledger row alone (the
jobs table and the ledger are the queue: ``jobs.claiming``). A qcluster would release
them; tests and the practice drill release them here instead: every effect the ledger
holds due now, once each, in due order.
"""

from __future__ import annotations

from django.db.models.functions import Coalesce

from jobs import rules
from jobs.delivery.release import release
from jobs.engine.job_machine import worker_identity
from jobs.models import Effect


def run_queued_effects(worker: str | None = None) -> dict[int, str]:
    """Release every due effect as ``worker``; returns outcomes by effect pk."""
    worker = worker or worker_identity()
    due = Effect.objects.filter(rules.to_q(rules.EFFECT_RELEASABLE)).select_related("job")
    order = Coalesce("next_attempt_at", "lease_expires_at", "created_at")
    return {effect.pk: release(effect, worker) for effect in due.order_by(order, "pk")}
