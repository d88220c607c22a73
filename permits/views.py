"""Reviewer pages: my queue, a request with its report, the report download, notices.

Every view needs a login, and every object goes through the reader's current
object permission (``permits.selectors``): what a user may not see answers 404,
the same as what does not exist, with the site's own 404 page (also when DEBUG
is on, so a stale link in the demo reads like one). The download checks again
on every request, so a revoked reviewer loses the report at once, also through
a copied link.

Reviewers read what happened in plain events (requested, being prepared, ready,
notice delivered, delivery retrying); worker identities, keys, hashes and
protocol words stay on the operators' pages in the admin.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from datetime import datetime
from functools import wraps

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from jobs.artifacts import read_verified
from jobs.exceptions import ArtifactCorrupt
from jobs.models import Attempt, Effect, Job, Notice
from jobs.queue import enqueue_restore
from permits import selectors, services
from permits.forms import DecisionForm, NewRevisionForm
from permits.models import PermitRequest

log = logging.getLogger("permits.views")

QUEUE_PAGE_SIZE = 10
NOTICES_PAGE_SIZE = 20
State = Job.State
Outcome = Attempt.Outcome


def friendly_404(view):
    """Answer a missing or not-permitted object with the site's 404 page, even with DEBUG on."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        try:
            return view(request, *args, **kwargs)
        except Http404:
            return _render(request, "404.html", {}, status=404)

    return wrapper


# --- report state and events in plain words ----------------------------------------


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
    State.QUEUED: ReportState(
        "queued", "Requested", "The report is waiting for its turn; it starts by itself.", False
    ),
    State.RUNNING: ReportState("running", "Being prepared", "The report is being prepared.", False),
    State.RETRY_WAIT: ReportState(
        "waiting",
        "Retrying soon",
        "A temporary problem interrupted the report; it is tried again by itself.",
        False,
    ),
    State.SUCCEEDED: ReportState("ready", "Ready", "The report is ready to download.", True),
    State.FAILED: ReportState(
        "failed",
        "Could not be built",
        "The report cannot be built as requested and is not tried again; operators can see why.",
        True,
    ),
    State.DEAD: ReportState(
        "failed",
        "Stopped",
        "Every allowed try failed; an operator will review it and can try again.",
        True,
    ),
    State.CANCELLED: ReportState("cancelled", "Cancelled", "An operator cancelled it.", True),
}

CAUSES = {
    "transport": "a network problem",
    "temporary": "a service that was briefly unavailable",
    "provider_timeout": "a service that did not answer in time",
    "validation": "invalid request data",
    "authorization": "a policy refusal",
    "unknown": "an unexpected error",
}

# Notice channels (effect providers) and delivery states, in a reviewer's words.
CHANNELS = {
    "inapp": ("Inbox", "inbox"),
    "webhook": ("Device", "device"),
    "email": ("E-mail", "e-mail"),
}
NOTICE_STATES = {
    # effect state: (badge tone, words)
    "pending": ("queued", "waiting to be sent"),
    "sending": ("running", "being sent"),
    "applied": ("ready", "delivered"),
    "unknown": ("waiting", "delivery retrying"),
    "withheld": ("none", "not sent: you were not assigned when it was due"),
    "failed": ("failed", "could not be delivered"),
    "needs_review": ("waiting", "an operator is checking the delivery"),
}
EVENT_TONES = {
    "queued": "muted",
    "ready": "ok",
    "waiting": "warn",
    "failed": "bad",
    "none": "muted",
}


def report_state(job: Job | None) -> ReportState:
    return NO_REPORT if job is None else REPORT_STATES[job.state]


@dataclass(frozen=True)
class Event:
    """One line of the report's story as a reviewer reads it."""

    tone: str
    text: str
    at: datetime | None


@dataclass(frozen=True)
class Delivery:
    """One of the reader's notices for the report: its channel and where it stands."""

    channel: str
    place: str
    state: str  # the ledger's state (pages and tests key on it)
    shown: str  # the state in the reviewer's words: a pending one already tried is retrying
    tone: str
    words: str
    at: datetime | None


def _cause(error_class: str) -> str:
    return CAUSES.get(error_class, "an error")


def attempt_events(job: Job, attempts) -> list[Event]:
    """Tries of the report in plain words; repeated queue deliveries and deferrals are left out."""
    events = [Event("muted", "Requested", job.created_at)]
    tries = [a for a in attempts if a.number > 0]
    for i, a in enumerate(tries):
        events.append(
            Event("running", "Being prepared again" if i else "Being prepared", a.started_at)
        )
        if a.outcome == Outcome.SUCCEEDED:
            events.append(Event("ok", "Ready", a.finished_at))
        elif a.outcome == Outcome.RETRY:
            events.append(
                Event(
                    "warn",
                    f"Interrupted by {_cause(a.error_class)}; tried again by itself",
                    a.finished_at,
                )
            )
        elif a.outcome in (Outcome.CRASHED, Outcome.LEASE_LOST):
            events.append(Event("warn", "Interrupted; picked up again by itself", a.finished_at))
        elif a.outcome == Outcome.FAILED:
            events.append(
                Event("bad", f"Could not be built: {_cause(a.error_class)}", a.finished_at)
            )
        elif a.outcome == Outcome.DEAD:
            events.append(
                Event(
                    "bad", "Stopped after its last try; an operator will review it", a.finished_at
                )
            )
    if job.state == State.DEAD and not any(a.outcome == Outcome.DEAD for a in tries):
        events.append(
            Event("bad", "Stopped: no tries left; an operator will review it", job.finished_at)
        )
    elif job.state == State.CANCELLED:
        events.append(Event("muted", "Cancelled by an operator", job.finished_at))
    return events


def notice_deliveries(job: Job | None, user) -> list[Delivery]:
    """The delivery state of each of this user's notices for the job, in plain words."""
    rows = []
    for effect in selectors.effects_for_recipient(job, user):
        channel, place = CHANNELS.get(effect.provider, ("Other", "other channel"))
        shown = effect.state
        if shown == Effect.State.PENDING and effect.attempts:
            shown = Effect.State.UNKNOWN  # tried already, waiting for the next try
        tone, words = NOTICE_STATES.get(shown, ("none", shown))
        at = effect.applied_at or effect.updated_at
        rows.append(Delivery(channel, place, effect.state, shown, tone, words, at))
    return rows


def notice_events(deliveries: list[Delivery]) -> list[Event]:
    """Each notice once it left the waiting line: delivered, retrying, withheld, ..."""
    return [
        Event(EVENT_TONES.get(d.tone, d.tone), f"Notice to your {d.place}: {d.words}", d.at)
        for d in deliveries
        if d.shown != Effect.State.PENDING
    ]


# --- helpers -----------------------------------------------------------------------


def _render(request: HttpRequest, template: str, context: dict, status: int = 200):
    if request.user.is_authenticated:
        context.setdefault("unread_notices", selectors.unread_notice_count(request.user))
    return render(request, template, context, status=status)


def _report_context(permit: PermitRequest, user) -> dict:
    job = selectors.report_job(permit)
    state = report_state(job)
    deliveries = notice_deliveries(job, user)
    # Keep polling until the reader's notices settled too (a retrying one included).
    settled = all(d.state in Effect.FINAL for d in deliveries)
    events = []
    if job is not None:
        events = attempt_events(job, selectors.attempts_of(job)) + notice_events(deliveries)
    status_text = " ".join(
        [state.explanation] + [f"Notice to your {d.place}: {d.words}." for d in deliveries]
    )
    return {
        "permit": permit,
        "job": job,
        "state": state,
        "finished": state.finished and settled,
        "artifact": selectors.artifact_of(job),
        "events": events,
        "deliveries": deliveries,
        "status_text": status_text,
    }


def _render_detail(request, permit: PermitRequest, *, decision_form=None):
    assigned = selectors.is_assigned(request.user, permit)
    history = [
        (job, report_state(job))
        for job in selectors.report_jobs_of(permit)
        if job.output_revision != permit.output_revision
    ]
    mine = selectors.current_decision(permit, request.user, permit.output_revision)
    if decision_form is None and (mine is None or request.GET.get("change")):
        decision_form = DecisionForm(permit=permit, current=mine)
    context = {
        **_report_context(permit, request.user),
        "assigned": assigned,
        "decisions": selectors.decisions_of(permit),
        "my_decision": mine,
        "decision_form": decision_form,
        "error_summary": decision_form.error_summary()
        if decision_form is not None and decision_form.errors
        else [],
        "history": history,
    }
    return _render(request, "permits/detail.html", context)


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
@friendly_404
@require_GET
def request_detail(request: HttpRequest, pk: int) -> HttpResponse:
    permit = selectors.request_for(request.user, pk)
    return _render_detail(request, permit)


@never_cache
@login_required
@friendly_404
@require_GET
def report_status(request: HttpRequest, pk: int) -> HttpResponse:
    """The report panel alone: the detail page polls it while anything in it may change."""
    permit = selectors.request_for(request.user, pk)
    response = render(request, "permits/_report.html", _report_context(permit, request.user))
    response["X-Unread-Notices"] = str(selectors.unread_notice_count(request.user))
    return response


@never_cache
@login_required
@friendly_404
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
@friendly_404
@require_http_methods(["GET", "POST"])
def request_revision(request: HttpRequest, pk: int) -> HttpResponse:
    """Rebuild the report as a new revision: GET asks to confirm, POST does it.

    A double submit of the same page bumps the revision once (the form carries
    the revision the reviewer saw).
    """
    permit = selectors.request_for(request.user, pk)
    if permit.is_withdrawn:
        messages.error(request, "The applicant withdrew this request: no new report is needed.")
        return redirect("request_detail", pk=permit.pk)
    if request.method == "GET":
        context = {
            "permit": permit,
            "next_revision": permit.output_revision + 1,
            "open_decisions": selectors.decisions_in_force(permit, permit.output_revision),
            "form": NewRevisionForm(initial={"seen_revision": permit.output_revision}),
        }
        return _render(request, "permits/rebuild.html", context)
    form = NewRevisionForm(request.POST)
    if not form.is_valid():
        messages.error(request, "That form was out of date. Look at the page again, then retry.")
    else:
        seen = form.cleaned_data["seen_revision"]
        _, created = services.request_new_revision(permit, seen_revision=seen)
        if created:
            messages.success(
                request,
                f"Rebuild started: the report is now revision {permit.output_revision}. "
                f"Decisions on revision {seen} stay in the history; decide again on "
                f"revision {permit.output_revision}.",
            )
        else:
            messages.info(
                request,
                f"Revision {permit.output_revision} was already started, perhaps in another "
                "window. No second report was started.",
            )
    return redirect("request_detail", pk=permit.pk)


@login_required
@friendly_404
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


def _retarget(form: DecisionForm, permit: PermitRequest, reviewer, refused: Exception):
    """The reviewer's answers kept, aimed at what is in force now: the current revision
    and the decision in force on it (so a resubmit changes that one, knowingly)."""
    data = form.data.copy()
    data["revision"] = str(permit.output_revision)
    current = selectors.current_decision(permit, reviewer, permit.output_revision)
    data["replaces"] = str(current.pk) if current is not None else ""
    again = DecisionForm(data, permit=permit)
    again.is_valid()
    again.add_error(None, str(refused))
    return again


@login_required
@friendly_404
@require_POST
def decide(request: HttpRequest, pk: int) -> HttpResponse:
    """Record (or, when the form says so, change) the reviewer's decision on this revision."""
    permit = selectors.request_for(request.user, pk)
    form = DecisionForm(request.POST, permit=permit)
    if form.is_valid():
        data = form.cleaned_data
        try:
            made, new = services.decide(
                permit,
                request.user,
                decision=data["decision"],
                comment=data["comment"].strip(),
                revision=data["revision"],
                replaces=data["replaces"],
            )
        except services.DecisionRefused as refused:
            permit.refresh_from_db()
            form = _retarget(form, permit, request.user, refused)
        else:
            label = made.get_decision_display()
            if new and made.is_change:
                messages.success(
                    request,
                    f"Decision changed to “{label}” on revision {made.revision}. "
                    "The earlier decision is kept in the history.",
                )
            elif new or not data["replaces"]:
                messages.success(
                    request, f"Decision recorded: “{label}” on revision {made.revision}."
                )
            else:
                messages.info(request, f"Nothing changed: your decision is still “{label}”.")
            return redirect("request_detail", pk=permit.pk)
    return _render_detail(request, permit, decision_form=form)


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
@friendly_404
@require_GET
def notice_open(request: HttpRequest, pk: int) -> HttpResponse:
    """Follow a notice to its request (whose page checks access itself)."""
    return redirect(_notice_target(request, selectors.notice_for(request.user, pk)))


@login_required
@friendly_404
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
