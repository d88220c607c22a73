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

import logging
import re
from dataclasses import dataclass
from datetime import datetime
from functools import wraps
from urllib.parse import quote, urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from jobs.artifacts import open_verified
from jobs.exceptions import ArtifactCorrupt, ArtifactLost, TemporaryFailure
from jobs.models import Attempt, Effect, Job, Notice
from jobs.ops import causes
from jobs.ops.words import effect_state_word, job_state_word, provider_words
from jobs.queue import enqueue_restore
from permits import letters, selectors, services
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
# The state's word is the report kind's own (its ``labels``, permits.reports.LABELS: the
# admin shows the same word) and the tone the engine's (``jobs.ops.words``); the
# reviewer's explanation of what it means for a report is ours.
EXPLANATIONS = {
    State.QUEUED: "The report is waiting for its turn; it starts by itself.",
    State.RUNNING: "The report is being prepared.",
    State.RETRY_WAIT: "A temporary problem interrupted the report; it is tried again by itself.",
    State.SUCCEEDED: "The report is ready to download.",
    State.FAILED: "The report cannot be built as requested and is not tried again; "
    "operators can see why.",
    State.DEAD: "Every allowed try failed; an operator will review it and can try again.",
    State.CANCELLED: "An operator cancelled it.",
}
CAUSES = {
    "transport": "a network problem",
    "temporary": "a service that was briefly unavailable",
    "provider_timeout": "a service that did not answer in time",
    "validation": "invalid request data",
    "authorization": "a policy refusal",
    "unknown": "an unexpected error",
}

# What a state means for the reader of a notice, around the shared word (lower-cased). Kept
# short: a notice's badge does not wrap, and it must fit a phone.
NOTICE_WORDING = {
    "withheld": "{word}: you were not assigned when it was due",
    "needs_review": "{word} by an operator",
}


def notice_state(state: str) -> tuple[str, str]:
    """(badge tone, words) of a notice's delivery state: the engine's word, lower-cased for
    the sentence "Notice to your inbox: delivered", with the reviewer's detail around it."""
    shared = effect_state_word(state)
    word = shared.word[:1].lower() + shared.word[1:]
    return shared.tone, NOTICE_WORDING.get(state, "{word}").format(word=word)


EVENT_TONES = {
    "queued": "muted",
    "ready": "ok",
    "waiting": "warn",
    "failed": "bad",
    "none": "muted",
}


def report_state(job: Job | None) -> ReportState:
    if job is None:
        return NO_REPORT
    word = job_state_word(job.state, job.kind)
    return ReportState(word.tone, word.word, EXPLANATIONS[job.state], job.state in Job.TERMINAL)


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


OPERATOR_ACTIONS = {
    "requeue": "An operator asked for it again",
    "retry_now": "An operator asked to try again now",
    "cancel": "Cancelled by an operator",
    "fail": "An operator ended it: it cannot be built as it was asked for",
}


def _hm(at: datetime | None) -> str:
    return "" if at is None else f"{timezone.localtime(at):%H:%M}"


def _round_events(tries: list, *, ended: str | None, ended_at: datetime | None) -> list[Event]:
    """One round of tries (between operator actions) in at most three lines.

    ``ended`` is the job state a finished round ended in (``failed``/``dead``), or None.
    A round that could not build the report is one plain sentence; interruptions that
    were tried again by themselves are counted on one line, not listed one by one.
    """
    if not tries:
        return []
    first, last = tries[0], tries[-1]
    if ended in (State.FAILED, State.DEAD) or last.outcome in (Outcome.FAILED, Outcome.DEAD):
        n = len(tries)
        when = _hm(first.started_at)
        until = _hm(last.finished_at or ended_at)
        span = f"at {when}" if n == 1 or when == until else f"between {when} and {until}"
        times = "once" if n == 1 else f"{n} times"
        cause = _cause(last.error_class)
        text = (
            f"We tried {times} {span} and could not build it ({cause}); "
            "the office's operators have been told"
        )
        return [Event("bad", text, last.finished_at or ended_at)]
    events = [Event("running", "Being prepared", first.started_at)]
    interrupted = [
        a for a in tries if a.outcome in (Outcome.RETRY, Outcome.CRASHED, Outcome.LEASE_LOST)
    ]
    if interrupted:
        causes = sorted({_cause(a.error_class) for a in interrupted if a.outcome == Outcome.RETRY})
        why = f" by {' and '.join(causes)}" if causes else ""
        times = "once" if len(interrupted) == 1 else f"{len(interrupted)} times"
        events.append(
            Event(
                "warn",
                f"Interrupted {times}{why}; tried again by itself",
                interrupted[-1].finished_at,
            )
        )
    if last.outcome == Outcome.SUCCEEDED:
        events.append(Event("ok", "Ready", last.finished_at))
    return events


def attempt_events(job: Job, attempts, operator_events=()) -> list[Event]:
    """The report's story in plain words: requested, each round of tries in a line or
    three, and what operators did (JobEvent rows) in between. Repeated queue deliveries
    and deferrals are left out; worker names and attempt numbers never appear."""
    events = [Event("muted", "Requested", job.created_at)]
    tries = [a for a in attempts if a.number > 0]
    actions = sorted(operator_events, key=lambda e: (e.at, e.pk))
    rounds: list[list] = [[]]
    marks = []
    for a in tries:
        while actions and actions[0].at <= a.started_at:
            marks.append((len(rounds) - 1, actions.pop(0)))
            rounds.append([])
        rounds[-1].append(a)
    for action in actions:
        marks.append((len(rounds) - 1, action))
        rounds.append([])
    marks_by_round = dict(marks)
    for i, round_tries in enumerate(rounds):
        is_last = i == len(rounds) - 1
        action = marks_by_round.get(i)
        ended = job.state if is_last else None
        if action is not None and action.action == "requeue":
            ended = action.from_state  # a requeue follows a round that stopped (failed/dead)
        events.extend(_round_events(round_tries, ended=ended, ended_at=job.finished_at))
        if action is not None:
            words = OPERATOR_ACTIONS.get(action.action, "An operator acted on it")
            events.append(
                Event(
                    "muted" if action.action == "cancel" else "running",
                    f"{words} at {_hm(action.at)}",
                    action.at,
                )
            )
    if job.state == State.DEAD and not tries:
        events.append(
            Event(
                "bad",
                "Stopped before any try; the office's operators have been told",
                job.finished_at,
            )
        )
    elif job.state == State.CANCELLED and not any(a.action == "cancel" for a in operator_events):
        events.append(Event("muted", "Cancelled by an operator", job.finished_at))
    return events


def notice_deliveries(job: Job | None, user) -> list[Delivery]:
    """The delivery state of each of this user's notices for the job, in plain words."""
    rows = []
    for effect in selectors.effects_for_recipient(job, user):
        provider = provider_words(effect.provider)
        channel, place = provider.label, provider.place
        shown = effect.state
        if shown == Effect.State.PENDING and effect.attempts:
            shown = Effect.State.UNKNOWN  # tried already, waiting for the next try
        tone, words = notice_state(shown)
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


def decision_wait(job: Job | None, permit: PermitRequest) -> str:
    """Why the decision is not open yet, and when it will be (empty once the report is ready)."""
    rev = permit.output_revision
    head = f"You can decide once the report of revision {rev} is ready: "
    if job is None:
        return head + "no report is being prepared. Generate it above."
    if job.state == State.CANCELLED:
        return head + "an operator cancelled it. Generate it again above."
    if job.state in services.PREPARING:
        return head + (
            "it is being prepared now, usually within a minute. This page updates by itself."
        )
    return head + "it could not be built. The office's operators have been told and can try again."


# --- helpers -----------------------------------------------------------------------


def _has_admin_duties(request: HttpRequest) -> bool:
    """Whether the admin would show this user anything (a staff flag alone is no duty)."""
    from django.contrib import admin

    if not request.user.is_staff:
        return False
    return any(
        request.user.has_module_perms(app_label)
        for app_label in {m._meta.app_label for m in admin.site._registry}
    )


def _render(request: HttpRequest, template: str, context: dict, status: int = 200):
    if request.user.is_authenticated:
        context.setdefault("unread_notices", selectors.unread_notice_count(request.user))
        context.setdefault("show_admin", _has_admin_duties(request))
    return render(request, template, context, status=status)


def _report_context(permit: PermitRequest, user) -> dict:
    job = selectors.report_job(permit)
    state = report_state(job)
    deliveries = notice_deliveries(job, user)
    # Keep polling until the reader's notices settled too (a retrying one included).
    settled = all(d.state in Effect.FINAL for d in deliveries)
    events = []
    if job is not None:
        events = attempt_events(
            job, selectors.attempts_of(job), selectors.operator_events_of(job)
        ) + notice_events(deliveries)
    # A stopped or retrying report says why in the reviewer's words, when the kind knows.
    cause = None
    if job is not None and job.state in (State.FAILED, State.DEAD, State.RETRY_WAIT):
        cause = causes.cause_of(job)
    explained = [state.explanation] + ([cause.reviewer] if cause and cause.reviewer else [])
    status_text = " ".join(
        explained + [f"Notice to your {d.place}: {d.words}." for d in deliveries]
    )
    ready = job is not None and job.state == State.SUCCEEDED
    return {
        "permit": permit,
        "job": job,
        "state": state,
        "report_ready": ready,
        "preparing": job is not None and job.state in services.PREPARING,
        "can_generate": job is None or job.state == State.CANCELLED,
        # Rebuild only where it can change the outcome; else the reason, in its place.
        "rebuild_refusal": services.rebuild_refusal(permit, job),
        "decision_wait": "" if ready else decision_wait(job, permit),
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
        "letter_words": letters.letter_words(mine) if mine is not None else "",
        "decision_form": decision_form,
        "error_summary": decision_form.error_summary()
        if decision_form is not None and decision_form.errors
        else [],
        "history": history,
    }
    return _render(request, "permits/detail.html", context)


def _report_filename(permit: PermitRequest, revision: int) -> str:
    return f"{permit.reference}-r{revision}.pdf"


def content_disposition(name: str, *, inline: bool = False) -> str:
    """``attachment`` (or ``inline``) with a sanitized ASCII ``filename`` and the exact name
    as RFC 6266's ``filename*`` (RFC 5987 UTF-8 encoding): no quote, backslash, path
    separator or control character of a reference reaches the header raw."""
    ascii_name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "report.pdf"
    kind = "inline" if inline else "attachment"
    return f"{kind}; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(name, safe='')}"


# --- pages -------------------------------------------------------------------------


@login_required
@require_GET
def queue(request: HttpRequest) -> HttpResponse:
    """My queue: "To do" (still in review) or "Decided", sorted by submitted date (newest
    first unless ``sort=oldest``), searchable by reference, each with its report's state."""
    view = "decided" if request.GET.get("view") == "decided" else "todo"
    sort = "oldest" if request.GET.get("sort") == "oldest" else "newest"
    q = request.GET.get("q", "").strip()[:40]
    mine = selectors.requests_for(request.user)
    counts = selectors.queue_counts(mine)
    found = selectors.queue_view(mine, view=view, oldest_first=sort == "oldest", reference=q)
    pages = Paginator(found, QUEUE_PAGE_SIZE)
    page = pages.get_page(request.GET.get("page"))
    permits = list(page.object_list)
    jobs = selectors.report_jobs_by_permit(permits)
    rows = [(p, jobs.get(p.pk), report_state(jobs.get(p.pk))) for p in permits]
    keep = {"view": view, "sort": sort, "q": q}
    context = {
        "page": page,
        "rows": rows,
        "nav": "queue",
        "view": view,
        "sort": sort,
        "q": q,
        "counts": counts,
        "page_query": urlencode({k: v for k, v in keep.items() if v}),
        "sort_query": urlencode({k: v for k, v in {"view": view, "q": q}.items() if v}),
    }
    return _render(request, "permits/queue.html", context)


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
    """Send the report, ``inline`` (the browser's PDF viewer opens it) or, with
    ``?download=1``, as an attachment; the object permission is checked on every request.

    Every byte served is read through ``open_verified``: streamed into a spool while its
    sha256 is checked, and served from the spool only once the whole file matched (flat
    memory, never an unverified byte). A
    missing or corrupt file is never sent: the reader gets a clear page and the engine
    is asked to restore it (``jobs.restore``; one restore in flight however many
    downloads). A lost artifact (its published bytes cannot be produced again) answers
    410 with "rebuild it as a new revision".
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
        verified = open_verified(artifact)  # the bytes served are the bytes checked
    except ArtifactLost:
        context = {"permit": permit, "revision": revision}
        return _render(request, "permits/report_lost.html", context, status=410)
    except ArtifactCorrupt:
        log.warning(
            "artifact=%s key=%s failed its sha256 check at download", artifact.pk, artifact.key
        )
        enqueue_restore(artifact)  # a no-op while a restore of it is in flight
        response = _render(
            request, "permits/report_unavailable.html", {"permit": permit}, status=503
        )
        response["Retry-After"] = "60"
        return response
    except TemporaryFailure as exc:  # the storage could not be read: nothing to restore
        log.warning("artifact=%s storage unavailable at download (%s)", artifact.pk, exc)
        response = _render(
            request, "permits/report_unavailable.html", {"permit": permit}, status=503
        )
        response["Retry-After"] = "60"
        return response
    log.info("permit=%s artifact=%s user=%s download", permit.pk, artifact.pk, request.user.pk)
    content_type = artifact.content_type or "application/pdf"
    inline = request.GET.get("download") != "1"
    # ``verified`` is closed (and its spool removed) by the response when sent.
    response = FileResponse(verified, as_attachment=not inline, content_type=content_type)
    response["Content-Disposition"] = content_disposition(
        _report_filename(permit, revision), inline=inline
    )
    return response


@login_required
@friendly_404
@require_http_methods(["GET", "POST"])
def request_revision(request: HttpRequest, pk: int) -> HttpResponse:
    """Rebuild the report as a new revision: GET asks to confirm, POST does it.

    A double submit of the same page bumps the revision once (the form carries
    the revision the reviewer saw). Bounded per user (``services.rebuild_report``): no
    rebuild while the current report is still being prepared, and at most
    ``REBUILD_LIMIT`` per ``REBUILD_LIMIT_WINDOW_MINUTES``.
    """
    permit = selectors.request_for(request.user, pk)
    if permit.is_withdrawn:
        messages.error(request, "The applicant withdrew this request: no new report is needed.")
        return redirect("request_detail", pk=permit.pk)
    refusal = services.rebuild_refusal(permit, selectors.report_job(permit))
    if request.method == "GET" and refusal:
        messages.info(request, refusal)
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
        try:
            _, created = services.rebuild_report(permit, request.user, seen_revision=seen)
        except services.RebuildRefused as refused:
            messages.error(request, str(refused))
            return redirect("request_detail", pk=permit.pk)
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
    """The fallback when no report is coming: none asked for yet, or an operator cancelled
    it (then the next revision is built, once per revision seen)."""
    permit = selectors.request_for(request.user, pk)
    if permit.is_withdrawn:
        messages.error(request, "The applicant withdrew this request: no report is needed.")
    else:
        seen = request.POST.get("seen_revision", "")
        seen_revision = int(seen) if seen.isdigit() else permit.output_revision
        _, created = services.regenerate_cancelled(permit, seen_revision=seen_revision)
        permit.refresh_from_db(fields=["output_revision"])
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
    job = selectors.report_job(permit)
    early = job is None or job.state != State.SUCCEEDED
    if form.is_valid() and early and form.cleaned_data["revision"] == permit.output_revision:
        # The form is disabled until the report is ready; this answers a hand-made or
        # stale POST. (A form for an older revision gets "the report moved" below.)
        form.add_error(None, decision_wait(job, permit))
        return _render_detail(request, permit, decision_form=form)
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
