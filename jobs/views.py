"""Operator endpoints: Prometheus metrics and the admin dashboard."""

from __future__ import annotations

import hmac
from datetime import timedelta

from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.db.models.functions import TruncMinute
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone

from jobs import conf, stats
from jobs.models import Attempt, Effect


def _token_ok(request: HttpRequest) -> bool:
    token = conf.get("METRICS_TOKEN")
    given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    return bool(token) and hmac.compare_digest(given.encode(), token.encode())


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text; operators' sessions or ``Authorization: Bearer $METRICS_TOKEN``."""
    user = request.user
    if not (_token_ok(request) or (user.is_active and user.has_perm("jobs.view_job"))):
        raise PermissionDenied
    from prometheus_client import CONTENT_TYPE_LATEST  # django-jobs-ledger[metrics]

    from jobs import metrics

    return HttpResponse(metrics.render(), content_type=CONTENT_TYPE_LATEST)


def timeline(minutes: int = 60, *, now=None) -> list[dict]:
    """Deliveries and applied effects per minute, the last ``minutes`` minutes."""
    now = (now or timezone.now()).replace(second=0, microsecond=0)
    start = now - timedelta(minutes=minutes - 1)
    deliveries = dict(
        Attempt.objects.filter(started_at__gte=start)
        .annotate(minute=TruncMinute("started_at"))
        .values_list("minute")
        .annotate(n=Count("id"))
        .order_by()
    )
    duplicates = dict(
        Attempt.objects.filter(started_at__gte=start, outcome=Attempt.Outcome.DUPLICATE_DELIVERY)
        .annotate(minute=TruncMinute("started_at"))
        .values_list("minute")
        .annotate(n=Count("id"))
        .order_by()
    )
    effects = dict(
        Effect.objects.filter(applied_at__gte=start)
        .annotate(minute=TruncMinute("applied_at"))
        .values_list("minute")
        .annotate(n=Count("id"))
        .order_by()
    )
    rows = []
    for i in range(minutes):
        minute = start + timedelta(minutes=i)
        rows.append(
            {
                "minute": minute,
                "deliveries": deliveries.get(minute, 0),
                "duplicates": duplicates.get(minute, 0),
                "effects": effects.get(minute, 0),
            }
        )
    return rows


def _chart(rows: list[dict], width: int = 720, height: int = 180) -> dict:
    """Polyline points for an inline SVG: no JavaScript, no build step."""
    peak = max([1] + [max(r["deliveries"], r["effects"]) for r in rows])
    step = width / max(1, len(rows) - 1)

    def points(key):
        return " ".join(
            f"{i * step:.1f},{height - r[key] * (height - 10) / peak:.1f}"
            for i, r in enumerate(rows)
        )

    return {
        "width": width,
        "height": height,
        "peak": peak,
        "deliveries": points("deliveries"),
        "duplicates": points("duplicates"),
        "effects": points("effects"),
    }


@staff_member_required
def dashboard_view(request: HttpRequest) -> HttpResponse:
    """The operator dashboard: the same figures as /metrics, and deliveries vs effects."""
    if not request.user.has_perm("jobs.view_job"):
        raise PermissionDenied
    rows = timeline(60)
    context = {
        **admin.site.each_context(request),
        "title": "Jobs dashboard",
        "stats": stats.collect(),
        "chart": _chart(rows),
        "first_minute": rows[0]["minute"],
        "last_minute": rows[-1]["minute"],
        "totals": {k: sum(r[k] for r in rows) for k in ("deliveries", "duplicates", "effects")},
    }
    return TemplateResponse(request, "jobs/dashboard.html", context)
