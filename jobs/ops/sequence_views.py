"""The console's Sequences page: the sequences whose next job waits, the job that holds
each, and the operators' release of a failed or dead holder (``jobs.sequences``). Served
by ``JobAdmin.get_urls``; a release is a POST (CSRF) and leaves an admin ``LogEntry``
beside the job's own event."""

from __future__ import annotations

import json

from django.contrib import admin, messages
from django.core.exceptions import BadRequest, PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from jobs import sequences
from jobs.models import Job
from jobs.ops.redrive_views import _operator, may_operate


@never_cache
@require_http_methods(["GET"])
def sequences_view(request: HttpRequest) -> HttpResponse:
    """The blocked sequences, each with the job holding it and why."""
    if not request.user.has_perm("jobs.view_job"):
        raise PermissionDenied
    context = {
        **admin.site.each_context(request),
        "title": "Blocked sequences",
        "blocked": sequences.blocked(),
        "can_operate": may_operate(request.user),
    }
    response = TemplateResponse(request, "jobs/sequences.html", context)
    response["Cache-Control"] = "no-store"
    return response


@never_cache
@require_http_methods(["POST"])
def release_view(request: HttpRequest) -> HttpResponse:
    """POST (operators, CSRF): the failed or dead job ``job`` lets its sequence go on."""
    if not may_operate(request.user):
        raise PermissionDenied
    try:
        holder = Job.objects.get(pk=int(request.POST.get("job", "")))
    except (ValueError, Job.DoesNotExist):
        raise BadRequest("no such job") from None
    note = str(request.POST.get("note", ""))[:300]
    if sequences.release(holder, operator=_operator(request), note=note):
        _audit(request, holder, note)
        messages.success(request, f"Job {holder.pk} released: its sequence goes on.")
    else:
        messages.warning(request, f"Job {holder.pk} holds no sequence (any more): nothing done.")
    return HttpResponseRedirect(reverse("admin:jobs_job_sequences"))


def _audit(request: HttpRequest, holder: Job, note: str) -> None:
    """The release's audit record: an admin ``LogEntry`` on the job (who, when, which key)."""
    from django.contrib.admin.models import CHANGE, LogEntry
    from django.contrib.contenttypes.models import ContentType

    LogEntry.objects.create(
        user_id=request.user.pk,
        content_type=ContentType.objects.get_for_model(Job, for_concrete_model=False),
        object_id=str(holder.pk),
        object_repr=f"Sequence released at job {holder.pk} ({holder.state})"[:200],
        action_flag=CHANGE,
        change_message=json.dumps(
            {
                "release_sequence": {
                    "job": holder.pk,
                    "key": holder.sequence_key,
                    "state": holder.state,
                    "by": _operator(request),
                    "note": note,
                }
            }
        ),
    )


def urls(site) -> list:
    """The Sequences pages under the jobs list (``JobAdmin.get_urls``)."""
    from django.urls import path

    return [
        path("sequences/", site.admin_view(sequences_view), name="jobs_job_sequences"),
        path(
            "sequences/release/",
            site.admin_view(release_view),
            name="jobs_job_sequence_release",
        ),
    ]
