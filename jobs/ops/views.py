"""Operator endpoints: Prometheus metrics and the operations console in the admin."""

from __future__ import annotations

import hmac

from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseNotFound
from django.template.response import TemplateResponse
from django.views.decorators.cache import never_cache

from jobs import conf, stats
from jobs.hooks import subject_labels
from jobs.ops import causes, console, flowview, tenantwait, trends
from jobs.ops.error_detail import can_view_error_detail

# What /metrics says when the Prometheus client is not installed: a 404 that names the
# extra, not a 500 (an operator can tell a missing install from a broken one).
METRICS_EXTRA_MISSING = (
    "Prometheus metrics need the [metrics] extra: pip install 'django-jobs-ledger[metrics]'\n"
)


def _token_ok(request: HttpRequest) -> bool:
    token = conf.get("METRICS_TOKEN")
    given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    return bool(token) and hmac.compare_digest(given.encode(), token.encode())


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text; operators' sessions or ``Authorization: Bearer $METRICS_TOKEN``."""
    user = request.user
    if not (_token_ok(request) or (user.is_active and user.has_perm("jobs.view_job"))):
        raise PermissionDenied
    try:
        from prometheus_client import CONTENT_TYPE_LATEST  # django-jobs-ledger[metrics]
    except ImportError:
        return HttpResponseNotFound(METRICS_EXTRA_MISSING, content_type="text/plain; charset=utf-8")
    from jobs.ops import metrics

    return HttpResponse(metrics.render(), content_type=CONTENT_TYPE_LATEST)


@never_cache
@staff_member_required
def dashboard_view(request: HttpRequest) -> HttpResponse:
    """The operations console: live counts that link to their lists, queue, workers, chart.

    ``?part=live`` answers the refreshing part alone (``jobs/console.js`` polls it).
    """
    if not request.user.has_perm("jobs.view_job"):
        raise PermissionDenied
    snap = console.snapshot()
    rows = snap.timeline
    retrying = [job for job, _ in snap.retrying_same]
    labels = subject_labels([*snap.failures, *retrying])
    detail = can_view_error_detail(request)

    def label(job) -> str:
        key = (job.subject_type, job.subject_id)
        return labels.get(key, f"{job.subject_type}:{job.subject_id}")

    # Each row says what failed in words first (``jobs.ops.causes``), the class and code after.
    failures = [
        (job, label(job), *console.error_of(job, detail=detail), causes.plain_words(job))
        for job in snap.failures
    ]
    retrying_rows = [
        (job, label(job), *console.error_of(job, detail=detail), same, causes.plain_words(job))
        for job, same in snap.retrying_same
    ]
    kind = request.GET.get("kind", "")[:64]
    outcomes = console.job_outcomes(60, kind=kind, now=snap.now)
    context = {
        **admin.site.each_context(request),
        "title": "Operations console",
        "kind": kind,
        "kinds": console.kinds(),
        "outcomes_chart": console.chart(outcomes, console.OUTCOME_SERIES),
        "outcome_totals": {k: sum(r[k] for r in outcomes) for k in console.OUTCOME_SERIES},
        "snap": snap,
        "health": console.health(snap),
        "failures": failures,
        "retrying": retrying_rows,
        "window": console.window_words(snap.window),
        "trends": trends.trends(snap.now),
        "stats": stats.collect(),
        "chart": console.chart(rows),
        "first_minute": rows[0]["minute"],
        "last_minute": rows[-1]["minute"],
        "totals": {k: sum(r[k] for r in rows) for k in console.SERIES},
        "flow": flowview.scope_views(),
        "tenant_waits": tenantwait.tenant_waits(snap.window, now=snap.now),
    }
    if request.GET.get("part") == "live":
        return TemplateResponse(request, "jobs/_console_live.html", context)
    return TemplateResponse(request, "jobs/dashboard.html", context)
