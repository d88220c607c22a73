"""Reviewer pages: my queue, a request with its report, the report download, notices.

Every view needs a login, and every object goes through the reader's current
object permission (``permits.selectors``): what a user may not see answers 404,
the same as what does not exist. The download checks again on every request,
so a revoked reviewer loses the report at once, also through a copied link.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST

from jobs.artifacts import read_verified
from jobs.exceptions import ArtifactCorrupt
from jobs.models import Attempt, Job, Notice
from jobs.queue import enqueue_restore
from permits import selectors, services
from permits.forms import DecisionForm, NewRevisionForm
from permits.models import PermitRequest

log = logging.getLogger("permits.views")

QUEUE_PAGE_SIZE = 10
NOTICES_PAGE_SIZE = 20
State = Job.State
Outcome = Attempt.Outcome


# --- report state and attempts in plain words ------------------------------------


@dataclass(frozen=True)
class ReportState:
    tone: str  # the badge's CSS modifier
    label: str
    explanation: str
    finished: bool  # nothing will change without someone acting: stop polling


NO_REPORT = ReportState(
    "none", "Not requested", "No report has been requested for this revision yet.", True
)
REPORT_STATES = {
    State.QUEUED: ReportState("queued", "Queued", "Waiting for a worker to pick it up.", False),
    State.RUNNING: ReportState("running", "Generating", "A worker is building the report.", False),
    State.RETRY_WAIT: ReportState(
        "waiting",
        "Retrying soon",
        "The last attempt hit a temporary problem; it will be tried again automatically.",
        False,
    ),
    State.SUCCEEDED: ReportState("ready", "Ready", "The report is ready to download.", True),
    State.FAILED: ReportState(
        "failed",
        "Failed",
        "The report cannot be built as requested and will not be retried; operators can see why.",
        True,
    ),
    State.DEAD: ReportState(
        "failed",
        "Stopped",
        "Every allowed attempt failed; an operator will review it and can try again.",
        True,
    ),
    State.CANCELLED: ReportState("cancelled", "Cancelled", "An operator cancelled it.", True),
}

ERROR_WORDS = {
    "transport": "a network problem",
    "temporary": "a temporarily unavailable dependency",
    "provider_timeout": "a provider that did not answer in time",
    "validation": "invalid request data",
    "authorization": "a policy refusal",
    "unknown": "an unexpected error",
}


def report_state(job: Job | None) -> ReportState:
    return NO_REPORT if job is None else REPORT_STATES[job.state]


@dataclass(frozen=True)
class TimelineEntry:
    tone: str
    text: str
    worker: str
    at: object  # datetime


def _worker_label(worker: str) -> str:
    """``host:pid`` of a ``host:pid:nonce`` worker identity."""
    parts = worker.rsplit(":", 1)
    return parts[0] if len(parts) == 2 else worker


def _cause(attempt: Attempt) -> str:
    words = ERROR_WORDS.get(attempt.error_class, "an error")
    return f"{words} ({attempt.error_code})" if attempt.error_code else words


def describe_attempt(attempt: Attempt, job: Job, *, later_claim: bool) -> TimelineEntry:
    """One delivery in words a reviewer understands."""
    who = f"Attempt {attempt.number} by worker {_worker_label(attempt.worker)}"
    outcome = attempt.outcome
    if outcome == Outcome.DUPLICATE_DELIVERY:
        tone, text = "muted", "A repeated queue delivery was ignored"
    elif outcome == Outcome.DEFERRED:
        tone, text = (
            "muted",
            "Delivery postponed: the office already had its limit of reports running",
        )
    elif outcome == Outcome.SUCCEEDED:
        tone, text = "ok", f"{who} — succeeded"
    elif outcome == Outcome.RETRY:
        delay = attempt.retry_delay_seconds
        after = f"; tried again after {delay:.1f} s" if delay is not None else "; tried again"
        tone, text = "warn", f"{who} — failed on {_cause(attempt)}{after}"
    elif outcome == Outcome.FAILED:
        tone, text = "bad", f"{who} — failed on {_cause(attempt)}; this is not retried"
    elif outcome == Outcome.DEAD:
        if attempt.number:
            text = f"{who} — failed on {_cause(attempt)}; no attempts left, an operator will review"
        else:
            text = "A delivery found no attempts left; the report stopped for operator review"
        tone = "bad"
    elif outcome == Outcome.CRASHED:
        tone = "warn"
        text = f"{who} — crashed; the lease ran out" + (
            " and another worker took over" if later_claim else ""
        )
    elif outcome == Outcome.LEASE_LOST:
        tone = "warn"
        text = f"{who} — lost its lease to another worker; its result was discarded"
    elif job.state == State.RUNNING and job.lease_owner == attempt.worker:
        tone, text = "running", f"{who} — working now"
    else:
        tone, text = "muted", f"{who} — no outcome recorded yet"
    return TimelineEntry(tone, text, attempt.worker, attempt.started_at)


def timeline(job: Job | None) -> list[TimelineEntry]:
    attempts = list(selectors.attempts_of(job))
    entries = []
    for i, attempt in enumerate(attempts):
        later_claim = any(a.number > attempt.number for a in attempts[i + 1 :])
        entries.append(describe_attempt(attempt, job, later_claim=later_claim))
    return entries


# --- helpers -----------------------------------------------------------------------


def _render(request: HttpRequest, template: str, context: dict, status: int = 200):
    context.setdefault("unread_notices", selectors.unread_notice_count(request.user))
    return render(request, template, context, status=status)


NOTICE_STATES = {
    # effect state: (tone, words a reviewer understands)
    "pending": ("queued", "waiting to be sent"),
    "sending": ("running", "being sent"),
    "applied": ("ready", "delivered"),
    "unknown": ("waiting", "sent, no answer yet: retrying with the same key"),
    "withheld": ("none", "withheld: you were not assigned when it was due"),
    "failed": ("failed", "refused by the provider"),
    "needs_review": ("waiting", "an operator is checking it"),
}
CHANNELS = {"inapp": "Inbox", "webhook": "Device (webhook)", "email": "E-mail"}


def notice_deliveries(job: Job | None, user) -> list[dict]:
    """The delivery state of each of this user's notices for the job, in plain words."""
    rows = []
    for effect in selectors.effects_for_recipient(job, user):
        tone, words = NOTICE_STATES.get(effect.state, ("none", effect.state))
        rows.append(
            {
                "channel": CHANNELS.get(effect.provider, effect.provider),
                "tone": tone,
                "words": words,
                "state": effect.state,
            }
        )
    return rows


def _report_context(permit: PermitRequest, user) -> dict:
    job = selectors.report_job(permit)
    state = report_state(job)
    # Keep polling until the notices went out too, so the unread count is current.
    finished = state.finished and not selectors.effects_settling(job)
    return {
        "permit": permit,
        "job": job,
        "state": state,
        "finished": finished,
        "artifact": selectors.artifact_of(job),
        "timeline": timeline(job),
        "deliveries": notice_deliveries(job, user),
        "revision_form": NewRevisionForm(initial={"seen_revision": permit.output_revision}),
    }


def _render_detail(request, permit: PermitRequest, *, decision_form=None, status: int = 200):
    assigned = selectors.is_assigned(request.user, permit)
    history = [
        (job, report_state(job))
        for job in selectors.report_jobs_of(permit)
        if job.output_revision != permit.output_revision
    ]
    context = {
        **_report_context(permit, request.user),
        "assigned": assigned,
        "decisions": selectors.decisions_of(permit),
        "decision_form": decision_form or DecisionForm(permit=permit),
        "history": history,
    }
    return _render(request, "permits/detail.html", context, status=status)


def _report_filename(permit: PermitRequest, revision: int) -> str:
    return f"{permit.reference}-r{revision}.pdf"


# --- pages -------------------------------------------------------------------------


@login_required
@require_GET
def queue(request: HttpRequest) -> HttpResponse:
    """My queue: requests I may review, newest first, with each current report's state."""
    pages = Paginator(selectors.requests_for(request.user), QUEUE_PAGE_SIZE)
    page = pages.get_page(request.GET.get("page"))
    permits = list(page.object_list)
    jobs = selectors.report_jobs_by_permit(permits)
    rows = [(p, jobs.get(p.pk), report_state(jobs.get(p.pk))) for p in permits]
    return _render(request, "permits/queue.html", {"page": page, "rows": rows, "nav": "queue"})


@login_required
@require_GET
def request_detail(request: HttpRequest, pk: int) -> HttpResponse:
    permit = selectors.request_for(request.user, pk)
    return _render_detail(request, permit)


@never_cache
@login_required
@require_GET
def report_status(request: HttpRequest, pk: int) -> HttpResponse:
    """The report panel alone: the detail page polls it while the report is unfinished."""
    permit = selectors.request_for(request.user, pk)
    response = render(request, "permits/_report.html", _report_context(permit, request.user))
    response["X-Unread-Notices"] = str(selectors.unread_notice_count(request.user))
    return response


@never_cache
@login_required
@require_GET
def report_download(request: HttpRequest, pk: int) -> HttpResponse:
    """Send the report; the object permission is checked again on every download.

    The stored bytes are checked against the artifact's sha256 first: a missing or
    corrupt file is never sent; the reader gets a clear page and the engine is asked
    to restore the file (``jobs.restore``).
    """
    permit = selectors.request_for(request.user, pk)
    revision = permit.output_revision
    if "revision" in request.GET:
        try:
            revision = int(request.GET["revision"])
        except ValueError:
            raise Http404("No such revision") from None
    artifact = selectors.artifact_of(selectors.report_job(permit, revision))
    if artifact is None:
        raise Http404("No finished report for this revision")
    try:
        data = read_verified(artifact)  # the bytes served are the bytes checked
    except ArtifactCorrupt:
        log.warning(
            "artifact=%s key=%s failed its sha256 check at download", artifact.pk, artifact.key
        )
        enqueue_restore(artifact)
        response = _render(
            request, "permits/report_unavailable.html", {"permit": permit}, status=503
        )
        response["Retry-After"] = "60"
        return response
    log.info("permit=%s artifact=%s user=%s download", permit.pk, artifact.pk, request.user.pk)
    return FileResponse(
        io.BytesIO(data),
        as_attachment=True,
        filename=_report_filename(permit, revision),
        content_type=artifact.content_type or "application/pdf",
    )


@login_required
@require_POST
def request_revision(request: HttpRequest, pk: int) -> HttpResponse:
    """Ask for a new output revision; a double submit of the same page bumps it once."""
    permit = selectors.request_for(request.user, pk)
    form = NewRevisionForm(request.POST)
    if permit.is_withdrawn:
        messages.error(request, "The applicant withdrew this request: no new report is needed.")
    elif not form.is_valid():
        messages.error(request, "That form was out of date. Reload the page and try again.")
    else:
        _, created = services.request_new_revision(
            permit, seen_revision=form.cleaned_data["seen_revision"]
        )
        if created:
            messages.success(
                request,
                f"Revision {permit.output_revision} requested. The report is being generated.",
            )
        else:
            messages.info(
                request,
                f"Revision {permit.output_revision} was already requested; "
                "this is its report. No second report was started.",
            )
    return redirect("request_detail", pk=permit.pk)


@login_required
@require_POST
def generate_report(request: HttpRequest, pk: int) -> HttpResponse:
    """Build the report of the current revision if nobody asked for it yet (idempotent)."""
    permit = selectors.request_for(request.user, pk)
    if permit.is_withdrawn:
        messages.error(request, "The applicant withdrew this request: no report is needed.")
    else:
        _, created = services.report_request(permit)
        if created:
            messages.success(request, f"Report for revision {permit.output_revision} requested.")
    return redirect("request_detail", pk=permit.pk)


@login_required
@require_POST
def decide(request: HttpRequest, pk: int) -> HttpResponse:
    permit = selectors.request_for(request.user, pk)
    form = DecisionForm(request.POST, permit=permit)
    if not form.is_valid():
        return _render_detail(request, permit, decision_form=form)
    made = services.decide(
        permit,
        request.user,
        decision=form.cleaned_data["decision"],
        comment=form.cleaned_data["comment"].strip(),
    )
    messages.success(request, f"Recorded: {made.get_decision_display().lower()}.")
    return redirect("request_detail", pk=permit.pk)


# --- notices -----------------------------------------------------------------------


@login_required
@require_GET
def notice_list(request: HttpRequest) -> HttpResponse:
    page = Paginator(selectors.notices_for(request.user), NOTICES_PAGE_SIZE).get_page(
        request.GET.get("page")
    )
    return _render(request, "permits/notices.html", {"page": page, "nav": "notices"})


def _notice_target(request: HttpRequest, notice: Notice) -> str:
    """The notice's own page link, when it is a safe local path; else the inbox."""
    link = notice.link
    if link.startswith("/") and url_has_allowed_host_and_scheme(
        link, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return link
    return reverse("notice_list")


@login_required
@require_GET
def notice_open(request: HttpRequest, pk: int) -> HttpResponse:
    """Follow a notice to its request (whose page checks access itself)."""
    return redirect(_notice_target(request, selectors.notice_for(request.user, pk)))


@login_required
@require_POST
def notice_read(request: HttpRequest, pk: int) -> HttpResponse:
    """Mark one of my notices read; with ``open`` also go to its request."""
    notice = selectors.notice_for(request.user, pk)
    services.mark_notices_read(request.user, pk=notice.pk)
    if "open" in request.POST:
        return redirect(_notice_target(request, notice))
    return redirect(reverse("notice_list") + _page_query(request))


@login_required
@require_POST
def notice_read_all(request: HttpRequest) -> HttpResponse:
    done = services.mark_notices_read(request.user)
    messages.success(request, f"Marked {done} notice{'s' if done != 1 else ''} read.")
    return redirect("notice_list")


def _page_query(request: HttpRequest) -> str:
    page = request.POST.get("page", "")
    return f"?page={page}" if page.isdigit() else ""
