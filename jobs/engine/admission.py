"""Whether a claimed job may start now: one procedure, the same on every database.

Pause, then concurrency, then rate, for the job's ``kind:``, ``tenant:`` and ``queue:``
scopes (a tenant without a concurrency row keeps ``JOBS_TENANT_CONCURRENCY``). A job
under a ``queue:`` rule is claimed by this procedure on every database: the PostgreSQL
statement leaves it to the ORM claim. The rates
come last and are taken **all-or-nothing**: every rated rule is judged first, and a
start is taken from each only if all of them allow one, so a refusal by the tenant's
rate never spends the kind's start. The ORM executor runs ``admit`` inside a
savepoint together with the claim's compare-and-swap, so a claim that does not win
gives every start back; the PostgreSQL statement runs the same procedure in
``jobs_flow_admits_v2`` (``jobs.rules.flow_function_sql``).

Rate: GCRA, a token bucket of burst 1 (``jobs.flow`` explains the choice). Work
held back is deferred, never failed, and spends no attempt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import OperationalError, connection, transaction

from jobs import clock, conf, rules
from jobs.engine.plan import Hold
from jobs.engine.refusals import refusal
from jobs.models import FlowRule, Job


def gcra(tat: datetime | None, now: datetime, interval: float) -> tuple[bool, datetime]:
    """The rate rule: (allowed, new TAT) when allowed, else (False, TAT: the due time).

    The PostgreSQL statements (``take``, ``jobs_flow_admits_v2``) are the same rule in SQL.
    """
    if tat is None or tat <= now:
        return True, max(tat or now, now) + timedelta(seconds=interval)
    return False, tat


@dataclass(frozen=True)
class Taken:
    """What one take on a rule's rate found."""

    ok: bool
    reason: str = ""  # "" | rate | paused
    delay: float = 0.0  # seconds (server clock) until the rate allows the next start


_TAKE_PG = f"""
WITH c AS (SELECT clock_timestamp() AS now),
took AS (
    UPDATE {{t}} r SET next_free_at = {rules.GCRA_NEXT_SQL.format(r="r.", now="c.now")}
    FROM c
    WHERE r.scope = %s AND NOT r.paused AND r.rate > 0
      AND {rules.GCRA_DUE_SQL.format(r="r.", now="c.now")}
    RETURNING r.next_free_at
)
SELECT (SELECT count(*) FROM took), r.paused, r.rate,
       EXTRACT(EPOCH FROM (r.next_free_at - c.now))
FROM c LEFT JOIN {{t}} r ON r.scope = %s
"""


def take(scope: str) -> Taken:
    """Take one start from ``scope``'s rate: one UPDATE of its row by the server's clock.

    A scope without a row or without a rate allows every start; a paused one none.
    (A sender's take, one rule at a time: ``jobs.flow.take_within``.)
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_TAKE_PG.format(t=FlowRule._meta.db_table), [scope, scope])
            took, paused, rate, ahead = cursor.fetchone()
        if took:
            return Taken(True)
        if paused:
            return Taken(False, "paused", paused_delay())
        if not rate:
            return Taken(True)
        return Taken(False, "rate", max(0.0, float(ahead or 0.0)))
    # SQLite: writers are serialized (transaction_mode=IMMEDIATE), so a read and a
    # write in one transaction are as atomic as the statement above.
    with transaction.atomic():
        row = FlowRule.objects.annotate(db_now=clock.ServerNow()).filter(scope=scope).first()
        if row is None or (not row.paused and not row.rate):
            return Taken(True)
        if row.paused:
            return Taken(False, "paused", paused_delay())
        ok, tat = gcra(row.next_free_at, row.db_now, row.interval_seconds)
        if not ok:
            return Taken(False, "rate", max(0.0, (tat - row.db_now).total_seconds()))
        FlowRule.objects.filter(pk=row.pk).update(next_free_at=tat)
        return Taken(True)


def paused_delay() -> float:
    return float(conf.get("JOBS_FLOW_PAUSED_DEFER_SECONDS")) * (1 + random.random())


def spread(rule: FlowRule | None) -> float:
    """A concurrency hold's jitter, up to one second: waiters come back apart, and soon (a
    slot frees when any running job ends; a rate's period is no measure of that)."""
    return random.uniform(0.0, 1.0)


def interval_jitter(rule: FlowRule) -> float:
    """A rate hold's jitter: within one interval (period / rate), never the whole period
    (6/h: at most 10 minutes past the rule's next allowed start, not an hour)."""
    return random.uniform(0.0, rule.interval_seconds)


def job_scopes(job: Job) -> list[str]:
    """The scopes a job's claim answers to, in the order they are judged."""
    scopes = [rules.kind_scope(job.kind)]
    if job.tenant_key:
        scopes.append(rules.tenant_scope(job.tenant_key))
    scopes.append(rules.queue_scope(job.queue))
    return scopes


def lock(lock_class: int, key: str) -> bool:
    """PostgreSQL: the transaction-level advisory lock (``lock_class``, hashtext(key)),
    waiting at most the transaction's lock timeout; False if it ran out. SQLite: True
    (``transaction_mode=IMMEDIATE`` already serializes every writer)."""
    if connection.vendor != "postgresql":
        return True
    try:
        with transaction.atomic(), connection.cursor() as cursor:  # a savepoint
            cursor.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [lock_class, key])
    except OperationalError as exc:
        if refusal(exc) != "lock_not_available":
            raise
        return False
    return True


def admit(job: Job, *, ruled: bool, default_tenant_bound: int) -> Hold | None:
    """Whether the job may start now (None) or what holds it back. On PostgreSQL the
    function ``jobs_flow_verdict_v2`` decides (``verdict``); elsewhere this procedure.

    Call inside the claim's transaction, in a savepoint that also holds the claim's
    compare-and-swap: the starts this takes stand only if the claim wins. ``ruled``:
    an active flow rule names the job's kind or tenant (else only the tenant's bound).
    """
    if connection.vendor == "postgresql":
        if not ruled and not job.tenant_key:
            return None
        return verdict(job, default_tenant_bound)
    found = {}
    if ruled:
        found = {r.scope: r for r in FlowRule.objects.filter(scope__in=job_scopes(job))}
    for scope in job_scopes(job):
        rule = found.get(scope)
        if rule is not None and rule.paused:
            return Hold(scope, "paused", paused_delay())
    hold = _kind_concurrency(job, found.get(rules.kind_scope(job.kind)))
    if hold is None and job.tenant_key:
        tenant = found.get(rules.tenant_scope(job.tenant_key))
        hold = _tenant_concurrency(job, tenant, default_tenant_bound, ruled=ruled)
    if hold is None:
        hold = _queue_concurrency(job, found.get(rules.queue_scope(job.queue)))
    if hold is None:
        hold = take_all([found[s] for s in job_scopes(job) if s in found and found[s].rate])
    return hold


def verdict_params(default_tenant_bound: int) -> list:
    """``jobs_flow_verdict_v2``'s parameters after the job's own (kind, tenant, queue, id)."""
    return [
        default_tenant_bound,
        float(conf.get("JOBS_FLOW_PAUSED_DEFER_SECONDS")),
        float(conf.get("JOBS_TENANT_DEFER_SECONDS")),
    ]


def hold_of(scope: str | None, reason: str | None, delay: float | None) -> Hold | None:
    """A verdict row of ``jobs_flow_verdict_v2`` as a ``Hold`` (None: the job may start)."""
    if not reason:
        return None
    return Hold(scope or "", reason, float(delay or 0.0))


def verdict(job: Job, default_tenant_bound: int) -> Hold | None:
    """PostgreSQL: ``admit`` by ``jobs_flow_verdict_v2`` (``jobs.engine.verdict_sql``), the
    one admission there. Its scope locks wait at most the transaction's lock timeout."""
    params = [job.kind, job.tenant_key, job.queue, job.pk, *verdict_params(default_tenant_bound)]
    try:
        with transaction.atomic(), connection.cursor() as cursor:  # a savepoint
            cursor.execute(
                "SELECT scope, reason, delay FROM jobs_flow_verdict_v2(%s, %s, %s, %s, %s, %s, %s)",
                params,
            )
            return hold_of(*cursor.fetchone())
    except OperationalError as exc:
        if refusal(exc) != "lock_not_available":
            raise
        return Hold(job_scopes(job)[0], "busy", paused_delay())


def _live_others(job: Job):
    return Job.objects.filter(rules.to_q(rules.LIVE_RUNNING)).exclude(pk=job.pk)


def _kind_concurrency(job: Job, rule: FlowRule | None) -> Hold | None:
    if rule is None or rule.concurrency is None:
        return None
    if not lock(rules.FLOW_LOCK_CLASS, rule.scope):
        return Hold(rule.scope, "busy", paused_delay())
    if _live_others(job).filter(kind=job.kind).count() >= rule.concurrency:
        return Hold(rule.scope, "concurrency", 0.2 + spread(rule))
    return None


def _queue_concurrency(job: Job, rule: FlowRule | None) -> Hold | None:
    """A ``queue:`` rule's concurrency: the live running jobs of the queue, counted under
    the scope's lock (held to the claim's commit, so two claims never both see room)."""
    if rule is None or rule.concurrency is None:
        return None
    if not lock(rules.FLOW_LOCK_CLASS, rule.scope):
        return Hold(rule.scope, "busy", paused_delay())
    if _live_others(job).filter(queue=job.queue).count() >= rule.concurrency:
        return Hold(rule.scope, "concurrency", 0.2 + spread(rule))
    return None


def _tenant_concurrency(
    job: Job, rule: FlowRule | None, default_bound: int, *, ruled: bool
) -> Hold | None:
    """The tenant's bound (its row's, else the setting), counted under the tenant's lock:
    the same lock ``jobs_tenant_admits_v2`` tries in the one-statement claim. Without
    any flow rule the hold is the plain tenant bound's (``JOBS_TENANT_DEFER_SECONDS``)."""
    scope = rules.tenant_scope(job.tenant_key)
    bound = rule.concurrency if rule is not None and rule.concurrency is not None else None
    bound = default_bound if bound is None else bound
    locked = lock(rules.TENANT_LOCK_CLASS, job.tenant_key)
    if locked and _live_others(job).filter(tenant_key=job.tenant_key).count() < bound:
        return None
    if not ruled:
        delay = float(conf.get("JOBS_TENANT_DEFER_SECONDS")) * (1 + random.random())
        return Hold(scope, "tenant_bound", delay)
    if not locked:
        return Hold(scope, "busy", paused_delay())
    return Hold(scope, "concurrency", 0.2 + spread(rule))


def take_all(rated: list[FlowRule]) -> Hold | None:
    """One start from every rule in ``rated``, or none at all: the rows are locked in id
    order, each judged by the server's clock, and written only if every one allows.

    Returns the first hold in the order given (the kind's before the tenant's)."""
    if not rated:
        return None
    order = {r.pk: i for i, r in enumerate(rated)}
    try:
        with transaction.atomic():  # a savepoint: a lock timeout leaves nothing taken
            rows = list(
                FlowRule.objects.select_for_update()
                .annotate(db_now=clock.ServerNow())
                .filter(pk__in=order)
                .order_by("pk")
            )
            decided = []
            for row in sorted(rows, key=lambda r: order[r.pk]):
                if row.paused:
                    return Hold(row.scope, "paused", paused_delay())
                if not row.rate:
                    continue
                ok, tat = gcra(row.next_free_at, row.db_now, row.interval_seconds)
                if not ok:
                    ahead = max(0.0, (tat - row.db_now).total_seconds())
                    # Due at the rule's next start, spread over one interval (not the
                    # period: 6/h waits at most 10 minutes past its next start).
                    return Hold(row.scope, "rate", ahead + interval_jitter(row))
                decided.append((row, tat))
            for row, tat in decided:
                FlowRule.objects.filter(pk=row.pk).update(next_free_at=tat)
    except OperationalError as exc:
        if refusal(exc) != "lock_not_available":
            raise
        return Hold(rated[0].scope, "busy", paused_delay())
    return None
