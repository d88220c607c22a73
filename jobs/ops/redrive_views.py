"""The console's Redrive pages: the groups with their counts, a confirmation naming the
count, and the redrive itself (``jobs.ops.redrive``). Served by ``JobAdmin.get_urls``."""

from __future__ import annotations

from django.contrib import admin, messages
from django.core.exceptions import BadRequest, PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from jobs.ops import redrive

FIELDS = ("target", "kind", "state", "error_class", "provider")


def may_operate(user) -> bool:
    """Operators: they may change jobs and effects (what every operator action asks)."""
    return user.is_active and all(
        user.has_perm(p) for p in ("jobs.change_job", "jobs.change_effect")
    )


def _operator(request: HttpRequest) -> str:
    return request.user.get_username() or f"user-{request.user.pk}"


@never_cache
@require_http_methods(["GET"])
def redrive_view(request: HttpRequest) -> HttpResponse:
    """The groups a redrive applies to, largest first, and the last redrives' records."""
    if not request.user.has_perm("jobs.view_job"):
        raise PermissionDenied
    context = {
        **admin.site.each_context(request),
        "title": "Redrive",
        "groups": redrive.groups(),
        "cap": redrive.cap(),
        "audits": redrive.audit_records(),
        "can_operate": may_operate(request.user),
    }
    return TemplateResponse(request, "jobs/redrive.html", context)


def _filter(data) -> redrive.Filter:
    try:
        return redrive.Filter(*(str(data.get(name, ""))[:200] for name in FIELDS))
    except redrive.RedriveError as exc:
        raise BadRequest(str(exc)) from None


@never_cache
@require_http_methods(["GET", "POST"])
def redrive_confirm_view(request: HttpRequest) -> HttpResponse:
    """GET: the confirmation, naming how many rows the redrive takes; POST (operators,
    CSRF): the redrive, then back to the groups with its counts."""
    if not may_operate(request.user):
        raise PermissionDenied
    group = _filter(request.POST if request.method == "POST" else request.GET)
    if request.method == "POST":
        result = redrive.redrive(group, operator=_operator(request), user_id=request.user.pk)
        messages.success(request, f"Redrive of {group.words()}: {result.words()}.")
        return HttpResponseRedirect(reverse("admin:jobs_job_redrive"))
    count = group.rows().count()
    cap = redrive.cap()
    context = {
        **admin.site.each_context(request),
        "title": "Confirm redrive",
        "group": group,
        "fields": [(name, getattr(group, name)) for name in FIELDS],
        "count": count,
        "taken": min(count, cap),
        "cap": cap,
    }
    response = TemplateResponse(request, "jobs/redrive_confirm.html", context)
    response["Cache-Control"] = "no-store"
    return response


def urls(site) -> list:
    """The Redrive pages under the jobs list (``JobAdmin.get_urls``)."""
    from django.urls import path

    return [
        path("redrive/", site.admin_view(redrive_view), name="jobs_job_redrive"),
        path(
            "redrive/confirm/",
            site.admin_view(redrive_confirm_view),
            name="jobs_job_redrive_confirm",
        ),
    ]
