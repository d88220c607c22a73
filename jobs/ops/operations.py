"""Operator actions: one table says what each does, when, and how it is worded.

Nobody edits engine fields by hand. Operator actions (retry now, cancel, requeue, fail
it; re-check and release, mark sent, send again) are buttons on a job's or effect's
page and actions on the lists; all of them call the engine's own service
functions (the same CAS transitions the workers use), say why when they do
nothing, and leave a ``LogEntry`` naming the operator. Where each applies is the
engine's rule (``jobs.rules.OPERATOR_SOURCES``), not spelled again here.

``OperableAdmin`` is the framework: the buttons, the confirmation with a preview,
the list actions with their confirmation and one summary entry, and the page that
follows an operation until its object settles.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.views.decorators.http import require_GET, require_http_methods

from jobs import rules, services
from jobs.engine import effect_machine, job_machine
from jobs.models import Attempt, Effect, Job, JobEvent
from jobs.ops import causes
from jobs.ops.console import error_of
from jobs.ops.reasons import REASON_MAX, check_reason
from jobs.ops.words import job_progress, job_state_word

log = logging.getLogger("jobs.admin")
JobState = Job.State
EffectState = Effect.State


@dataclass(frozen=True)
class Operation:
    name: str
    label: str  # the button
    done: str  # "Requeued 1 of 2 selected."
    explains: str  # shown next to the button
    run: Callable[[object, str], bool]  # (job or effect, operator username) -> won
    # Beyond its states: whether it has anything to do on this object, and why not.
    when: Callable[[object], bool] | None = None
    why_not_when: str = ""
    # What the operator should know before pressing it on this object ("" for nothing):
    # it still applies, but may not do what they hope (no worker serves the queue, ...).
    warn: Callable[[object], str] | None = None
    # The operator says why (a required text on the confirmation, at most REASON_MAX
    # characters): ``run`` then takes it as a third argument. One object at a time, so
    # never a list action.
    needs_reason: bool = False
    verb: str = ""  # the label as a verb before the object ("Fail job 7?"), when it differs

    @property
    def does(self) -> str:
        return self.verb or self.label

    def warning(self, obj) -> str:
        return self.warn(obj) if self.warn is not None else ""

    @property
    def states(self) -> tuple[str, ...]:
        """Where it applies (the engine's own source states); elsewhere the reason is given."""
        return rules.OPERATOR_SOURCES[self.name]

    def applies(self, obj) -> bool:
        return obj.state in self.states and (self.when is None or self.when(obj))


def _unserved_queue(job) -> str:
    """Retry now in a queue no worker serves runs nothing: say so, with the command."""
    from jobs.ops.serving import queue_unserved

    command = queue_unserved(job.queue)
    if not command:
        return ""
    return (
        f"No worker serves queue {job.queue}: retrying now changes nothing until one "
        f"runs ({command})."
    )


_NOTHING_RUNS_OTHERWISE = (
    "its cause is its own parameters, so running it again fails the same way; fail it "
    "with the reason instead"
)


def _requeue_warning(job) -> str:
    """A group child's requeue after its join already ended does not run the join again."""
    if job.group_id is None:
        return ""
    join = job.group.join
    if join is None or join.state not in Job.TERMINAL:
        return ""
    return (
        f"Its group's join (job {join.pk}) has already {join.state.replace('_', ' ')}: "
        "requeueing this child runs the child alone, not the join again."
    )


JOB_OPERATIONS = {
    op.name: op
    for op in (
        Operation(
            "retry_now",
            "Retry now",
            "Retried",
            "Run it now instead of at its backoff time.",
            lambda job, operator: services.retry_job_now(job, operator=operator),
            when=causes.requeue_helps,
            why_not_when=_NOTHING_RUNS_OTHERWISE,
            warn=_unserved_queue,
        ),
        Operation(
            "cancel",
            "Cancel",
            "Cancelled",
            "Stop it: a waiting job at once; a running one at its next check, publishing "
            "nothing. It will not be tried again.",
            lambda job, operator: services.cancel_job(job, operator=operator),
            # A waiting job its own parameters stop is failed with the reason instead.
            when=lambda job: job.state == JobState.RUNNING or causes.requeue_helps(job),
            why_not_when=_NOTHING_RUNS_OTHERWISE,
        ),
        Operation(
            "cancel_follow_ups",
            "Cancel follow-ups",
            "Cancelled the follow-ups of",
            "Stop the jobs it requested that are not running (and theirs); a running one "
            "finishes, and a group's join will not run.",
            lambda job, operator: services.cancel_follow_ups(job, operator=operator),
            when=services.has_follow_ups_to_cancel,
            why_not_when="none of its follow-ups is waiting to run",
        ),
        Operation(
            "requeue",
            "Requeue",
            "Requeued",
            "Give it a fresh attempt budget and queue it again (earlier attempts stay listed).",
            lambda job, operator: services.requeue_job(job, operator=operator),
            when=causes.requeue_helps,
            why_not_when=(
                "its cause is its own parameters, so a requeue would fail the same way; "
                "leave it failed"
            ),
            warn=_requeue_warning,
        ),
        Operation(
            "fail",
            "Fail it",
            "Failed",
            "Nothing can make it run otherwise: end it failed, never tried again, with your "
            "reason in its history.",
            lambda job, operator, reason: job_machine.fail_by_operator(
                job, actor=f"operator:{operator}", reason=reason
            ),
            when=lambda job: not causes.requeue_helps(job),
            why_not_when="its cause may still be fixed (its subject, a requeue): fail only a "
            "job nothing can help",
            needs_reason=True,
            verb="Fail",
        ),
    )
}
EFFECT_OPERATIONS = {
    op.name: op
    for op in (
        Operation(
            "recheck_and_release",
            "Re-check and release",
            "Queued for a recheck:",
            "Queue it for a worker to check the recipient's access again and send if allowed.",
            lambda effect, operator: services.recheck_and_release(effect, operator=operator),
        ),
        Operation(
            "mark_sent",
            "Mark sent",
            "Marked sent",
            "You confirmed delivery out of band: record it as applied, send nothing.",
            lambda effect, operator: effect_machine.mark_sent(
                effect, operator=operator, note="admin action"
            ),
        ),
        Operation(
            "send_again",
            "Send again",
            "Queued to send again:",
            "Queue one more send under the same key for a worker (an e-mail may arrive twice).",
            lambda effect, operator: effect_machine.send_again(
                effect, operator=operator, note="admin action"
            ),
        ),
    )
}


SETTLED_EFFECT = (
    EffectState.APPLIED,
    EffectState.WITHHELD,
    EffectState.FAILED,
    EffectState.NEEDS_REVIEW,
)


def _operator(request) -> str:
    return request.user.get_username() or f"user-{request.user.pk}"


def _states(op: Operation) -> str:
    return " or ".join(s.replace("_", " ") for s in op.states)


def _describe(obj) -> str:
    return f"job {obj.pk}" if isinstance(obj, Job) else f"effect {obj}"


def same_error_as_before_requeue(job: Job) -> str:
    """When a requeued job stopped again with the error it stopped with before the requeue,
    the error's words ("" otherwise): the cause is still there, requeueing again won't help."""
    if not isinstance(job, Job) or job.state not in (JobState.DEAD, JobState.FAILED):
        return ""
    requeue = JobEvent.objects.filter(job=job, action="requeue").order_by("-at", "-id").first()
    if requeue is None:
        return ""
    before = (
        Attempt.objects.filter(job=job, started_at__lt=requeue.at)
        .exclude(error_class="")
        .order_by("-started_at", "-id")
        .first()
    )
    if before is None or (before.error_class, before.error_code) != (
        job.last_error_class,
        job.last_error_code,
    ):
        return ""
    return " · ".join(x for x in (job.last_error_class, job.last_error_code) if x)


def preview(op: Operation, obj) -> str:
    """What the operation will do to this object, in one sentence (the confirmation page)."""
    state = obj.state.replace("_", " ")
    if isinstance(obj, Job):
        cls, message = error_of(obj)
        error = ""
        if obj.last_error_class:
            same = Attempt.objects.filter(
                job=obj, error_class=obj.last_error_class, error_code=obj.last_error_code
            ).count()
            words = " ".join(x for x in (cls, message) if x and x != "—")
            # The tries as the job page counts them (attempts of its budget), so the two agree.
            error = f", {words} on {same} of its tries; tries {obj.attempts} of {obj.max_attempts}"
        again = same_error_as_before_requeue(obj)
        tail = (
            " — the same error as before its last requeue: the cause may still be there"
            if again
            else ""
        )
        return f"{op.does} job {obj.pk} ({state}{error}){tail}. {op.explains}"
    return f"{op.label} effect {obj} ({state}, {obj.provider}). {op.explains}"


def _why_not(op: Operation, obj) -> str:
    if obj.state not in op.states:
        state = obj.state.replace("_", " ")
        return f"{_describe(obj)} is {state}; {op.label} applies to {_states(op)} ones"
    if not op.applies(obj):
        return f"{_describe(obj)}: {op.why_not_when}"
    return f"{_describe(obj)} changed meanwhile (a worker or another operator moved it first)"


class OperableAdmin(admin.ModelAdmin):
    """Buttons on the change page and list actions, from one table of operations."""

    operations: dict[str, Operation] = {}

    def has_operate_permission(self, request) -> bool:
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    def operate(self, request, obj, op: Operation, reason: str = "") -> tuple[bool, str]:
        """Run ``op`` on ``obj``; log it with the operator's name when it changed something."""
        before = obj.state
        if op.when is not None and not op.when(obj):
            # What cannot help is not done, whatever posted it (a requeue of a job whose
            # own parameters are its cause); the state is the engine's CAS to judge.
            return False, _why_not(op, obj)
        if op.needs_reason:
            won = op.run(obj, _operator(request), reason)
        else:
            won = op.run(obj, _operator(request))
        if won:
            obj.refresh_from_db()
            if obj.state == before:
                # Asked, not yet done (a running job cancels at its next check): never
                # "Cancel: running → running".
                change = f"{op.label}: asked while {before.replace('_', ' ')}"
            else:
                change = f"{op.label}: {before} → {obj.state}"
            if reason:
                change = f"{change}, because: {reason}"
            self.log_change(request, obj, change)
            return True, ""
        return False, _why_not(op, obj)

    # Filters a bulk summary may name: kinds, states, providers and error *classes* are
    # the engine's own words; a search term or a payload value could quote private data.
    summary_filters: dict[str, str] = {
        "kind": "kind",
        "state": "state",
        "provider": "provider",
        "last_error_class": "error",
    }

    def bulk_scope(self, request) -> str:
        """The list's filter in the engine's words (``kind=…, state=dead, error=KeyError``) for
        a bulk summary; a search is said to be there, its term is left out."""
        parts = []
        for key, value in request.GET.items():
            field = key.split("__", 1)[0]
            if field in self.summary_filters and value:
                parts.append(f"{self.summary_filters[field]}={value}")
        if request.GET.get("q"):
            parts.append("with a search")
        return ", ".join(parts)

    def log_bulk(self, request, op: Operation, done: int, selected: int, across: bool) -> None:
        """One admin ``LogEntry`` for the whole bulk action (each object has its own too):
        counts, the filter's engine words and the operator; no params, messages or search."""
        noun = self.opts.verbose_name if done == 1 else self.opts.verbose_name_plural
        scope = self.bulk_scope(request)
        repr_ = f"Bulk {op.label.lower()}: {done} {noun}" + (f" ({scope})" if scope else "")
        chosen = "all matching the filter" if across else "selected"
        LogEntry.objects.create(
            user_id=request.user.pk,
            content_type=ContentType.objects.get_for_model(self.model, for_concrete_model=False),
            object_id=None,
            object_repr=repr_[:200],
            action_flag=CHANGE,
            change_message=f"{repr_}; {done} of {selected} {chosen} done, "
            f"{selected - done} not (each changed one has its own entry).",
        )

    def operate_many(self, request, queryset, op: Operation) -> None:
        """Run ``op`` on each object (each logged on its own), then one summary entry."""
        objs = list(queryset)
        refused = []
        for obj in objs:
            won, why = self.operate(request, obj, op)
            if not won:
                refused.append(why)
        done = len(objs) - len(refused)
        text = f"{op.done} {done} of {len(objs)} selected."
        across = request.POST.get("select_across") == "1"
        self.log_bulk(request, op, done, len(objs), across)
        log.info(
            "bulk operation=%s model=%s operator=%s done=%d selected=%d scope=%s",
            op.name,
            self.opts.model_name,
            _operator(request),
            done,
            len(objs),
            self.bulk_scope(request) or "-",
        )
        if refused:
            text += (
                " Not done: " + "; ".join(refused[:5]) + (" …" if len(refused) > 5 else "") + "."
            )
        self.message_user(request, text, messages.SUCCESS if not refused else messages.WARNING)

    def confirm_many(self, request, queryset, op: Operation) -> HttpResponse:
        """The confirmation of a list action: how many, which apply, a sample with errors."""
        objs = list(queryset.order_by("pk"))
        applies = [o for o in objs if op.applies(o)]
        sample = []
        for obj in applies[:BULK_SAMPLE]:
            cls, message = error_of(obj) if isinstance(obj, Job) else (obj.provider, obj.reason)
            sample.append((obj, cls, message))
        context = {
            **self.admin_site.each_context(request),
            "title": f"{op.label} {len(applies)} "
            f"{self.opts.verbose_name if len(applies) == 1 else self.opts.verbose_name_plural}?",
            "opts": self.opts,
            "op": op,
            "count": len(objs),
            "applies": len(applies),
            "skipped": len(objs) - len(applies),
            "sample": sample,
            "more": max(0, len(applies) - BULK_SAMPLE),
            "action": request.POST.get("action", op.name),
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "filters": request.GET.urlencode(),
            "states": _states(op),
        }
        return TemplateResponse(request, "admin/jobs/operate_many_confirm.html", context)

    def _url_name(self, view: str) -> str:
        return f"{self.opts.app_label}_{self.opts.model_name}_{view}"

    def get_urls(self):
        return [
            path(
                "<path:object_id>/operate/<str:operation>/",
                self.admin_site.admin_view(
                    require_http_methods(["GET", "POST"])(self.operate_view)
                ),
                name=self._url_name("operate"),
            ),
            path(
                "<path:object_id>/follow/",
                self.admin_site.admin_view(require_GET(self.follow_view)),
                name=self._url_name("follow"),
            ),
            *super().get_urls(),
        ]

    @staticmethod
    def _pk(object_id: str) -> int:
        try:
            return int(object_id)
        except ValueError:
            raise Http404("No such object") from None

    def operate_view(self, request: HttpRequest, object_id: str, operation: str) -> HttpResponse:
        """GET: confirm, with a preview of what will happen. POST: run one operation, then
        back to the page, which follows the outcome until it settles."""
        op = self.operations.get(operation)
        if op is None:
            raise Http404("No such operation")
        if not self.has_operate_permission(request):
            raise PermissionDenied
        obj = get_object_or_404(self.get_queryset(request), pk=self._pk(object_id))
        change_url = reverse(f"admin:{self._url_name('change')}", args=[obj.pk])
        reason, reason_error = "", ""
        if request.method == "POST" and op.needs_reason:
            reason, reason_error = check_reason(request.POST.get("reason", ""))
        if request.method == "GET" or reason_error:
            context = {
                **self.admin_site.each_context(request),
                "title": f"{op.does} {_describe(obj)}?",
                "opts": self.opts,
                "original": obj,
                "op": op,
                "applies": op.applies(obj),
                "why_not": "" if op.applies(obj) else _why_not(op, obj),
                "preview": preview(op, obj),
                "warning": op.warning(obj) if op.applies(obj) else "",
                "change_url": change_url,
                "reason": reason if reason_error else "",
                "reason_error": reason_error,
                "reason_max": REASON_MAX,
            }
            status = 400 if reason_error else 200
            return TemplateResponse(
                request, "admin/jobs/operate_confirm.html", context, status=status
            )
        won, why = self.operate(request, obj, op, reason)
        if won:
            self.message_user(request, f"{op.label}: done for {_describe(obj)}.", messages.SUCCESS)
            return HttpResponseRedirect(change_url + "?follow=1")
        self.message_user(request, f"{op.label}: not done, {why}.", messages.WARNING)
        return HttpResponseRedirect(change_url)

    def follow_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Where the object stands now, for the change page that follows an operation and
        for an open job page's live progress (``jobs/live.js``): its view permission
        asked, like the page's."""
        obj = get_object_or_404(self.get_queryset(request), pk=self._pk(object_id))
        if not self.has_view_permission(request, obj):
            raise PermissionDenied
        settled = obj.state in getattr(obj, "TERMINAL", ()) or obj.state in SETTLED_EFFECT
        state = obj.state.replace("_", " ")
        text = f"Now {state}."
        if isinstance(obj, Job):
            text = f"Now {state}, {obj.attempts} of {obj.max_attempts} attempts used."
            again = same_error_as_before_requeue(obj)
            if again:
                text = (
                    f"Stopped again ({state}) with {again}, the same error as before the "
                    "requeue: the cause is still there. Fix it before requeueing again."
                )
            elif settled:
                text = f"Settled: {state}."
        elif settled:
            text = f"Settled: {state}."
        answer = {"state": obj.state, "settled": settled, "text": text}
        if isinstance(obj, Job):
            answer["progress"] = job_progress(obj)
            answer["state_word"] = job_state_word(obj.state, obj.kind).word
        response = JsonResponse(answer)
        response["Cache-Control"] = "no-store"
        return response

    def bulk_log(self) -> list[LogEntry]:
        """The last bulk summaries on this model (object-less entries), for the list page."""
        return list(
            LogEntry.objects.filter(
                content_type=ContentType.objects.get_for_model(
                    self.model, for_concrete_model=False
                ),
                object_id=None,
                action_flag=CHANGE,
            )
            .select_related("user")
            .order_by("-action_time", "-id")[:BULK_LOG_SHOWN]
        )

    def changelist_view(self, request, extra_context=None):
        extra_context = {**(extra_context or {}), "bulk_log": self.bulk_log()}
        return super().changelist_view(request, extra_context=extra_context)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        obj = self.get_object(request, object_id) if object_id.isdigit() else None
        extra = {**(extra_context or {})}
        if obj is not None:
            can = self.has_operate_permission(request)
            extra["operations"] = [
                OfferedOperation(op.name, op.label, op.explains, op.warning(obj))
                for op in self.operations.values()
                if can and op.applies(obj)
            ]
            extra["cause"] = causes.plain_words(obj) if isinstance(obj, Job) else ""
            extra["no_action_helps"] = (
                isinstance(obj, Job)
                and can
                and not extra["operations"]
                and not causes.requeue_helps(obj)
            )
            extra["can_operate"] = can
            extra["operation_url"] = f"admin:{self._url_name('operate')}"
            extra["follow_url"] = reverse(f"admin:{self._url_name('follow')}", args=[obj.pk])
            extra["follow"] = request.GET.get("follow") == "1"
            # An open page of unfinished work keeps its state and progress current.
            extra["live"] = (
                isinstance(obj, Job) and not extra["follow"] and obj.state not in obj.TERMINAL
            )
            extra["same_error"] = same_error_as_before_requeue(obj)
            extra["operator_log"] = LogEntry.objects.filter(
                content_type__app_label=self.opts.app_label,
                content_type__model=self.opts.model_name,
                object_id=str(obj.pk),
            ).select_related("user")[:10]
        return super().change_view(request, object_id, form_url, extra_context=extra)


@dataclass(frozen=True)
class OfferedOperation:
    """An operation as the change page offers it on one object, with its warning."""

    name: str
    label: str
    explains: str
    warning: str = ""


BULK_SAMPLE = 10
BULK_LOG_SHOWN = 5


def list_actions(operations: dict[str, Operation]) -> list[Callable]:
    """The list actions of ``operations``: those that need no reason (a reason is one
    object's, given on its own page)."""
    return [operation_action(op) for op in operations.values() if not op.needs_reason]


def operation_action(op: Operation) -> Callable:
    """A list action that runs ``op`` on the selection, after a confirmation page."""

    def action(modeladmin, request, queryset):
        # First a confirmation with the count and a sample (Django's delete pattern: the
        # page posts the same selection back with ``confirmed``); then one audit row per
        # object (LogEntry, and the engine's own event) and one summary message.
        if request.POST.get("confirmed") != "yes":
            return modeladmin.confirm_many(request, queryset, op)
        modeladmin.operate_many(request, queryset, op)

    action.__name__ = op.name
    action.allowed_permissions = ("operate",)
    action.short_description = f"{op.label} ({_states(op)})"
    return action
