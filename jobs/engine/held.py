"""The jobs a scope's rule holds back, and their release when the rule gives way.

A pause (``jobs.flow.set_rule``) holds the scope's waiting jobs in one update
(``Job.held_by``); a job asked for later is held by the first claim that meets it (the
admission's verdict: paused, ``job_machine.defer``). A resume or a deleted rule releases
them: their due times were kept, so they take their old places in the queue. Held jobs
are outside the claim's partial indexes (migration 0022), so no claim reads a paused
backlog.

A rate or concurrency hold defers a job to a later due time instead, naming the scope
(``Job.deferred_by``, until it starts). Deleting or loosening that rule
(``release_deferred``, from ``set_rule`` and ``delete_rule``: the console, ``jobs_limits``
and the admin all change rules there) makes those jobs due at once and wakes their
queues: they wait for no deadline the old rule set.
"""

from __future__ import annotations

from datetime import timedelta

from django.db.models.functions import Now

from jobs import conf, queue, rules
from jobs.models import FlowRule, Job

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


def release_deferred(scope: str) -> int:
    """Make the waiting jobs ``scope``'s rule deferred due now (the rule was deleted or
    loosened), in their order, and wake their queues when this commits. A claim that holds
    one of them (it may be deciding about it, waiting for this rule's row) is passed over:
    it reads the rule as changed once this commits. Returns how many."""
    rows = Job.objects.filter(rules.to_q(rules.WAITING), deferred_by=scope[:200])
    later = rows.filter(next_attempt_at__gt=Now()).select_for_update(skip_locked=True)
    free = list(later.values_list("pk", "queue"))
    if not free:
        return 0
    released = Job.objects.filter(pk__in=[pk for pk, _ in free]).update(
        next_attempt_at=Now(), deferred_by=""
    )
    queue.notify_queues(sorted({name for _, name in free}))
    return released


# (rate, period seconds, concurrency) as a rule had them
Limits = tuple[int | None, float, int | None]


def limits(rule: FlowRule | None) -> Limits:
    """What of a rule a loosening compares (``loosened``)."""
    if rule is None:
        return (None, 1.0, None)
    return (rule.rate, rule.period_seconds, rule.concurrency)


def loosened(scope: str, before: Limits, rule: FlowRule) -> bool:
    """Whether ``rule`` allows more than ``before`` did: a rate removed or with a shorter
    interval, a concurrency removed or raised (a tenant's bound without a rule is the
    ``JOBS_TENANT_CONCURRENCY`` setting)."""
    rate, period, bound = before
    if rate and (not rule.rate or rule.period_seconds / rule.rate < period / rate):
        return True
    now = rule.concurrency
    if scope.startswith(rules.FLOW_TENANT_PREFIX):  # no bound of its own: the setting's
        bound = conf.tenant_concurrency() if bound is None else bound
        now = conf.tenant_concurrency() if now is None else now
    return bound is not None and (now is None or now > bound)


def after_change(scope: str, before: Limits, rule: FlowRule) -> int:
    """A rule was changed (``jobs.flow.set_rule``, inside its transaction): when it was
    loosened, its rate's next start comes forward to the new interval after the last
    start, and the jobs it deferred are due now. Returns how many were released."""
    if not loosened(scope, before, rule):
        return 0
    rate, period, _ = before
    if rate and rule.rate and rule.next_free_at is not None:
        # The last start was one old interval before the next one it allowed.
        earlier = timedelta(seconds=period / rate - rule.period_seconds / rule.rate)
        if earlier > timedelta(0):
            rule.next_free_at -= earlier
    return release_deferred(scope)
