"""The dispatcher: due retries, expired leases, stuck effects — one message each.

A job's message goes to its own queue (``jobs.queue.list_key``), so a re-drive
wakes only the workers that serve that queue.

A job that stays due long after its message was sent (the message was lost, or
sits in a cluster that died) gets one more after the re-drive window
(``JOBS_REDRIVE_AFTER_SECONDS``, default twice ``Q_CLUSTER['retry']``).

Run by a django-q2 schedule and, finer-grained, by ``manage.py jobs_dispatcher``.
Several dispatchers may run at once: each message is guarded by a conditional
UPDATE of ``enqueued_for`` in the transaction that enqueues it.
"""

from __future__ import annotations

import logging

from django.db import transaction

from jobs import queue, rules, schedules
from jobs.engine import groups
from jobs.models import Effect, Job
from jobs.reconcile import timeline
from jobs.services import enqueue_effect, enqueue_job, mark_enqueued, needs_message

log = logging.getLogger("jobs.dispatch")


def dispatch_once(*, limit: int = 500) -> dict[str, int]:
    """Enqueue what is due now by the server's clock; returns how many messages were sent."""
    sent = {"due_jobs": 0, "expired_leases": 0, "effects": 0}
    # Periodic kinds: each due tick is one job, created with its message (jobs.schedules).
    sent["ticks"] = sum(handle.created for handle in schedules.fire_due())
    # Group children ended outside an arrow (an operator's edit): counted, joins requested.
    sent["group_ends"] = groups.sweep()
    timeline.watch()  # issue 47: a promotion (new timeline) is reconciled once (jobs.reconcile)
    plans = [
        ("due_jobs", Job, rules.JOB_DUE, "next_attempt_at", enqueue_job),
        ("expired_leases", Job, rules.JOB_LEASE_EXPIRED, "lease_expires_at", enqueue_job),
        ("effects", Effect, rules.EFFECT_DUE, "next_attempt_at", enqueue_effect),
        ("effects", Effect, rules.EFFECT_LEASE_EXPIRED, "lease_expires_at", enqueue_effect),
    ]
    if queue.claims_jobs():
        # Due jobs, expired leases and due effects are claimed from their rows: no message
        # to send (jobs.claiming).
        plans = []
    for label, model, rule, field, enqueue in plans:
        qs = model.objects.filter(rules.to_q(rule), needs_message(field))
        # A job's message goes to its own queue's list (``jobs.queue.list_key``).
        extra = ("queue",) if model is Job else ()
        rows = qs.order_by(field).values_list("pk", field, "state", *extra)
        for pk, due_at, state, *route in rows[:limit]:
            with transaction.atomic():
                if mark_enqueued(model, pk, field, due_at, [state]):
                    enqueue(model(pk=pk, **dict(zip(extra, route, strict=True))))
                    sent[label] += 1
    if any(sent.values()):
        log.info("dispatch %s", " ".join(f"{k}={v}" for k, v in sent.items()))
    return sent
