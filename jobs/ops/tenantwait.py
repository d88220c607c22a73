"""Each tenant's wait over the console's window: the fair share as operators watch it.

A start's wait is its attempt's ``started_at`` minus the time its job was due
(``Attempt.due_at``, written by the claim: the job's ``next_attempt_at``, else its
request; a reclaimed job's expired lease). It counts everything the job waited behind:
other tenants' turns, its tenant's own bound or rate, a pause, its sequence's earlier
items. Attempts from before migration 0039 have no due time and are left out.

The 95th percentile is interpolated between the two nearest waits (PostgreSQL's
``percentile_cont``; SQLite's figures are computed here by the same rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection
from django.db.models import Count
from django.utils import timezone

from jobs import rules
from jobs.models import Attempt, Job

# Attempts that started nothing: a delivery that found the job taken, a deferral.
_NOT_STARTS = (Attempt.Outcome.DEFERRED, Attempt.Outcome.DUPLICATE_DELIVERY)


@dataclass(frozen=True)
class TenantWait:
    tenant: str  # "" for jobs requested without a tenant
    starts: int  # starts in the window
    p50_seconds: float | None
    p95_seconds: float | None
    waiting: int  # its jobs waiting now


def percentile(values: list[float], p: float) -> float | None:
    """``percentile_cont(p)``: linear between the two nearest of the sorted values."""
    if not values:
        return None
    ordered = sorted(values)
    at = p * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def tenant_waits(window: timedelta, *, now: datetime | None = None) -> list[TenantWait]:
    """Every tenant with a start in ``window`` or a job waiting now, busiest first."""
    # A constant bound (the console's stamp), not the server's clock_timestamp(): the
    # BRIN index on started_at can take a constant only.
    since = (now or timezone.now()) - window
    figures = _figures_pg(since) if connection.vendor == "postgresql" else _figures(since)
    waiting = dict(
        Job.objects.filter(rules.to_q(rules.WAITING))
        .values_list("tenant_key")
        .annotate(n=Count("id"))
        .values_list("tenant_key", "n")
    )
    tenants = set(figures) | set(waiting)
    rows = [TenantWait(t, *figures.get(t, (0, None, None)), waiting.get(t, 0)) for t in tenants]
    return sorted(rows, key=lambda r: (-r.starts, -r.waiting, r.tenant))


def _starts(since: datetime):
    # No order: the model's (job, start) would join every attempt of the window to its job.
    return (
        Attempt.objects.filter(started_at__gte=since, number__gt=0, due_at__isnull=False)
        .exclude(outcome__in=_NOT_STARTS)
        .order_by()
    )


def _figures(since: datetime) -> dict[str, tuple[int, float | None, float | None]]:
    waits: dict[str, list[float]] = {}
    for tenant, started, due in _starts(since).values_list(
        "job__tenant_key", "started_at", "due_at"
    ):
        waits.setdefault(tenant, []).append(max(0.0, (started - due).total_seconds()))
    return {t: (len(w), percentile(w, 0.5), percentile(w, 0.95)) for t, w in waits.items()}


def _figures_pg(since: datetime) -> dict[str, tuple[int, float | None, float | None]]:
    """The same figures, aggregated by the server (a busy window has many starts)."""
    sql, params = _starts(since).values("job_id", "started_at", "due_at").query.sql_with_params()
    job_t = Job._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"""SELECT j.tenant_key, count(*),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY w.s),
                percentile_cont(0.95) WITHIN GROUP (ORDER BY w.s)
            FROM (SELECT a.job_id, GREATEST(0, EXTRACT(EPOCH FROM a.started_at - a.due_at)) AS s
                  FROM ({sql}) a) w
            JOIN {job_t} j ON j.id = w.job_id GROUP BY j.tenant_key""",
            params,
        )
        return {t: (n, float(p50), float(p95)) for t, n, p50, p95 in cursor.fetchall()}
