"""Operator screens: jobs with their attempts and effects, read-only engine state.

Nobody edits engine fields by hand. Operator actions (retry now, cancel, requeue;
re-check and release, mark sent, send again) are buttons on a job's or effect's
page and actions on the lists; all of them call the engine's own service
functions (the same CAS transitions the workers use), say why when they do
nothing, and leave a ``LogEntry`` naming the operator.

The app knows nothing of the site's subjects (``jobs`` never imports the site):
a site tells it how to name and find them with ``register_subject``, e.g. so
that searching the jobs list for a permit reference finds its report jobs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from django.apps import apps
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.db.models import Case, F, IntegerField, JSONField, Sum, Value, When, Window
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, path, reverse
from django.utils import formats, timezone
from django.utils.html import format_html
from django.views.decorators.http import require_GET, require_http_methods

from jobs import artifacts, failures, ledger, services, stats, words
from jobs.console import error_of
from jobs.exceptions import ArtifactCorrupt, TemporaryFailure
from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, JobEvent, Notice

log = logging.getLogger("jobs.admin")
JobState = Job.State
EffectState = Effect.State

# --- subjects: how a site names and finds the things its jobs are about --------------------


@dataclass(frozen=True)
class SubjectHooks:
    """How the admin shows and searches one subject type (set by the site, not the app)."""

    labels: Callable[[list[str]], dict[str, str]]  # subject ids -> human labels
    search: Callable[[str], Iterable[object]]  # search term -> matching subject ids


SUBJECTS: dict[str, SubjectHooks] = {}


def register_subject(
    subject_type: str,
    *,
    labels: Callable[[list[str]], dict[str, str]],
    search: Callable[[str], Iterable[object]],
) -> None:
    """Let the jobs admin label ``subject_type`` subjects and find their jobs by those labels."""
    SUBJECTS[subject_type] = SubjectHooks(labels, search)


def subject_labels(jobs: Iterable[Job]) -> dict[tuple[str, str], str]:
    """Labels for the jobs' subjects, one query per subject type present."""
    wanted: dict[str, set[str]] = {}
    for job in jobs:
        if job.subject_type in SUBJECTS:
            wanted.setdefault(job.subject_type, set()).add(job.subject_id)
    found = {}
    for subject_type, ids in wanted.items():
        for subject_id, label in SUBJECTS[subject_type].labels(sorted(ids)).items():
            found[(subject_type, str(subject_id))] = label
    return found


def subject_admin_url(subject_type: str, subject_id: str) -> str | None:
    """The subject's admin page when its model is registered there (by app label and model)."""
    try:
        model = apps.get_model(subject_type)
    except (LookupError, ValueError):
        return None
    if not admin.site.is_registered(model):
        return None
    opts = model._meta
    try:
        return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[subject_id])
    except NoReverseMatch:
        return None


# --- operator actions: one table says what each does, when, and how it is worded -----------


@dataclass(frozen=True)
class Operation:
    name: str
    label: str  # the button
    done: str  # "Requeued 1 of 2 selected."
    explains: str  # shown next to the button
    states: tuple[str, ...]  # where it applies; elsewhere the reason is given
    run: Callable[[object, str], bool]  # (job or effect, operator username) -> won


JOB_OPERATIONS = {
    op.name: op
    for op in (
        Operation(
            "retry_now",
            "Retry now",
            "Retried",
            "Run it now instead of at its backoff time.",
            (JobState.QUEUED, JobState.RETRY_WAIT),
            lambda job, operator: services.retry_job_now(job, operator=operator),
        ),
        Operation(
            "cancel",
            "Cancel",
            "Cancelled",
            "Stop it before it runs; it will not be tried again.",
            (JobState.QUEUED, JobState.RETRY_WAIT),
            lambda job, operator: services.cancel_job(job, operator=operator),
        ),
        Operation(
            "requeue",
            "Requeue",
            "Requeued",
            "Give it a fresh attempt budget and queue it again (earlier attempts stay listed).",
            (JobState.FAILED, JobState.DEAD),
            lambda job, operator: services.requeue_job(job, operator=operator),
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
            (EffectState.WITHHELD,),
            lambda effect, operator: services.recheck_and_release(effect, operator=operator),
        ),
        Operation(
            "mark_sent",
            "Mark sent",
            "Marked sent",
            "You confirmed delivery out of band: record it as applied, send nothing.",
            (EffectState.NEEDS_REVIEW,),
            lambda effect, operator: ledger.mark_sent(
                effect, operator=operator, note="admin action"
            ),
        ),
        Operation(
            "send_again",
            "Send again",
            "Queued to send again:",
            "Queue one more send under the same key for a worker (an e-mail may arrive twice).",
            (EffectState.NEEDS_REVIEW,),
            lambda effect, operator: ledger.send_again(
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
            tried = Attempt.objects.filter(job=obj, number__gt=0).count()
            words = " ".join(x for x in (cls, message) if x and x != "—")
            error = f", {words} on {same} of {tried} attempt{'s' if tried != 1 else ''}"
        again = same_error_as_before_requeue(obj)
        tail = (
            " — the same error as before its last requeue: the cause may still be there"
            if again
            else ""
        )
        return f"{op.label} job {obj.pk} ({state}{error}){tail}. {op.explains}"
    return f"{op.label} effect {obj} ({state}, {obj.provider}). {op.explains}"


def _why_not(op: Operation, obj) -> str:
    if obj.state not in op.states:
        state = obj.state.replace("_", " ")
        return f"{_describe(obj)} is {state}; {op.label} applies to {_states(op)} ones"
    return f"{_describe(obj)} changed meanwhile (a worker or another operator moved it first)"


class OperableAdmin(admin.ModelAdmin):
    """Buttons on the change page and list actions, from one table of operations."""

    operations: dict[str, Operation] = {}

    def has_operate_permission(self, request) -> bool:
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    def operate(self, request, obj, op: Operation) -> tuple[bool, str]:
        """Run ``op`` on ``obj``; log it with the operator's name when it changed something."""
        before = obj.state
        won = op.run(obj, _operator(request))
        if won:
            obj.refresh_from_db()
            self.log_change(request, obj, f"{op.label}: {before} → {obj.state}")
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
        applies = [o for o in objs if o.state in op.states]
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
        if request.method == "GET":
            context = {
                **self.admin_site.each_context(request),
                "title": f"{op.label} {_describe(obj)}?",
                "opts": self.opts,
                "original": obj,
                "op": op,
                "applies": obj.state in op.states,
                "why_not": "" if obj.state in op.states else _why_not(op, obj),
                "preview": preview(op, obj),
                "change_url": change_url,
            }
            return TemplateResponse(request, "admin/jobs/operate_confirm.html", context)
        won, why = self.operate(request, obj, op)
        if won:
            self.message_user(request, f"{op.label}: done for {_describe(obj)}.", messages.SUCCESS)
            return HttpResponseRedirect(change_url + "?follow=1")
        self.message_user(request, f"{op.label}: not done, {why}.", messages.WARNING)
        return HttpResponseRedirect(change_url)

    def follow_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Where the object stands now, for the change page that follows an operation."""
        obj = get_object_or_404(self.get_queryset(request), pk=self._pk(object_id))
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
        return JsonResponse({"state": obj.state, "settled": settled, "text": text})

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
                op for op in self.operations.values() if can and obj.state in op.states
            ]
            extra["can_operate"] = can
            extra["operation_url"] = f"admin:{self._url_name('operate')}"
            extra["follow_url"] = reverse(f"admin:{self._url_name('follow')}", args=[obj.pk])
            extra["follow"] = request.GET.get("follow") == "1"
            extra["same_error"] = same_error_as_before_requeue(obj)
            extra["operator_log"] = LogEntry.objects.filter(
                content_type__app_label=self.opts.app_label,
                content_type__model=self.opts.model_name,
                object_id=str(obj.pk),
            ).select_related("user")[:10]
        return super().change_view(request, object_id, form_url, extra_context=extra)


BULK_SAMPLE = 10
BULK_LOG_SHOWN = 5


def _operation_action(op: Operation):
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


# --- list filters ------------------------------------------------------------------------


def value_filter(field: str, title: str):
    """A filter on ``field``'s values, the empty value listed as "none" (never as an empty link)."""

    class ValueFilter(admin.SimpleListFilter):
        parameter_name = field

        def lookups(self, request, model_admin):
            values = (
                model_admin.get_queryset(request)
                .exclude(**{field: ""})
                .values_list(field, flat=True)
                .distinct()
                .order_by(field)
            )
            return [(v, v.replace("_", " ")) for v in values] + [("-", "none")]

        def queryset(self, request, queryset):
            value = self.value()
            if value is None:
                return queryset
            return queryset.filter(**{field: "" if value == "-" else value})

    ValueFilter.title = title
    ValueFilter.__name__ = f"{field.title().replace('_', '')}Filter"
    return ValueFilter


# --- inlines -----------------------------------------------------------------------------


class ReadOnlyInline(admin.TabularInline):
    """History rows of the object on the page; left out when there are none (an empty
    table says nothing, and on a phone it is a scroll box with nothing to focus)."""

    extra = 0
    can_delete = False
    show_change_link = True

    def has_rows(self, obj) -> bool:
        return self.model._default_manager.filter(**{self.fk_name: obj}).exists()


def numbered_attempts(queryset):
    """Attempts with ``try_no``: the job's tries counted in order (jobs requeued before
    requeues grew the budget instead of resetting the count repeat a ``number``;
    ``try_no`` never does)."""
    tried = Case(When(number__gt=0, then=Value(1)), default=Value(0), output_field=IntegerField())
    return queryset.annotate(
        try_no=Window(
            Sum(tried), partition_by=[F("job_id")], order_by=[F("started_at").asc(), F("id").asc()]
        )
    )


# --- error detail: messages and tracebacks, for those who hold view_error_detail ------------

ERROR_DETAIL_PERMISSION = "jobs.view_error_detail"


def can_view_error_detail(request) -> bool:
    """Messages and tracebacks may quote data: shown only with ``jobs.view_error_detail``."""
    return request.user.has_perm(ERROR_DETAIL_PERMISSION)


def error_block(type_path: str, message: str, traceback: str):
    """``KeyError: 'pool'`` above its traceback (a collapsed block when there is one)."""
    if not type_path:
        return "—"
    head = failures.headline(type_path, message)
    if not traceback:
        return format_html('<code class="jobs-error">{}</code>', head)
    return format_html(
        '<details class="jobs-error"><summary><code>{}</code></summary>'
        '<pre class="jobs-traceback">{}</pre></details>',
        head,
        traceback,
    )


def _when(at) -> str:
    """A compact local time with seconds: lists and history rows compare instants."""
    return "—" if at is None else formats.date_format(timezone.localtime(at), "Y-m-d H:i:s")


class JobEventInline(ReadOnlyInline):
    model = JobEvent
    fk_name = "job"
    fields = readonly_fields = ("at", "action", "actor", "from_state", "to_state", "note")
    show_change_link = False
    verbose_name_plural = "Operator actions (who moved the job, committed with the move)"


class AttemptInline(ReadOnlyInline):
    model = Attempt
    fk_name = "job"
    fields = readonly_fields = (
        "try_number",
        "in_budget",
        "worker",
        "started",
        "finished",
        "outcome",
        "error_class",
        "error_code",
        "error_detail",
        "retry_after",
    )
    verbose_name_plural = "Attempts (every delivery that reached a worker, oldest first)"

    def get_fields(self, request, obj=None):
        fields = list(super().get_fields(request, obj))
        if can_view_error_detail(request):
            fields.insert(fields.index("error_detail") + 1, "error")
        return fields

    def get_readonly_fields(self, request, obj=None):
        return self.get_fields(request, obj)

    @admin.display(description="error and traceback")
    def error(self, obj):
        return error_block(obj.error_type, obj.error_message, obj.error_traceback)

    def get_queryset(self, request):
        attempts = super().get_queryset(request).select_related("job")
        return numbered_attempts(attempts).order_by("started_at", "id")

    @admin.display(description="try")
    def try_number(self, obj):
        return obj.try_no if obj.number else "—"

    @admin.display(description="started")
    def started(self, obj):
        return _when(obj.started_at)

    @admin.display(description="finished")
    def finished(self, obj):
        return _when(obj.finished_at)

    @admin.display(description="retry after")
    def retry_after(self, obj):
        return "—" if obj.retry_delay_seconds is None else f"{obj.retry_delay_seconds:.2f} s"

    @admin.display(description="of budget")
    def in_budget(self, obj):
        # Attempt.number: the job's attempt count at the claim. A requeue grows the budget,
        # so it keeps counting; jobs requeued by older releases restarted at 1 ("try" did not).
        return obj.number or "—"

    @admin.display(description="detail")
    def error_detail(self, obj):
        # Attempts keep class and code; the job keeps the detail of its last error only.
        job = obj.job
        last = (obj.error_class, obj.error_code) == (job.last_error_class, job.last_error_code)
        return job.last_error_detail if obj.error_class and last else "—"


class EffectInline(ReadOnlyInline):
    model = Effect
    fk_name = "job"
    fields = readonly_fields = (
        "effect_id",
        "provider_word",
        "state_word",
        "attempts",
        "reason",
        "applied_at",
    )

    @admin.display(description="provider")
    def provider_word(self, obj):
        return words.provider_tag(obj.provider)

    @admin.display(description="state")
    def state_word(self, obj):
        return _state(obj)


class ArtifactInline(ReadOnlyInline):
    model = Artifact
    fk_name = "job"
    fields = readonly_fields = ("key", "sha256", "size", "content_type", "created_at", "rewrites")


class EngineAdmin(OperableAdmin):
    """Everything read-only: state changes only through operations."""

    class Media:
        css = {"all": ["jobs/admin.css"]}
        js = ["jobs/follow.js"]

    def get_inline_instances(self, request, obj=None):
        inlines = super().get_inline_instances(request, obj)
        if obj is None:
            return inlines
        return [i for i in inlines if not isinstance(i, ReadOnlyInline) or i.has_rows(obj)]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def lookup_allowed(self, lookup, value, request):
        # Params and effect data are a kind's free-form payload: the engine cannot tell
        # what is private in them, so a URL may not filter on them (?params__x__startswith=
        # would answer yes or no per prefix). Refused with 400 like any disallowed lookup.
        payloads = {f.name for f in self.opts.get_fields() if isinstance(f, JSONField)}
        if lookup.split("__", 1)[0] in payloads:
            return False
        return super().lookup_allowed(lookup, value, request)


class LastErrorColumn:
    """A list column for rows with ``last_error_class``/``last_error_code``."""

    @admin.display(description="last error", ordering="last_error_class")
    def last_error(self, obj):
        if not obj.last_error_class:
            return "—"
        return " · ".join(x for x in (obj.last_error_class, obj.last_error_code) if x)


def _state(obj) -> str:
    return words.state_tag(obj.state, effect=isinstance(obj, Effect))


def state_filter(model):
    """The state filter in the shared words with the engine's name ("Stopped · dead"); the
    URL keeps the engine's value (``?state__exact=dead``), as links and bookmarks use it."""
    table = words.EFFECT_STATE_WORDS if model is Effect else words.JOB_STATE_WORDS

    class StateFilter(admin.SimpleListFilter):
        title = "state"
        parameter_name = "state__exact"

        def lookups(self, request, model_admin):
            return [(s, f"{w.word} · {s.replace('_', ' ')}") for s, w in table.items()]

        def queryset(self, request, queryset):
            value = self.value()
            return queryset if value is None else queryset.filter(state=value)

    return StateFilter


@admin.register(Job)
class JobAdmin(LastErrorColumn, EngineAdmin):
    operations = JOB_OPERATIONS
    actions = [_operation_action(op) for op in JOB_OPERATIONS.values()]
    list_display = ("id", "subject_and_kind", "state_word", "tries", "last_error", "updated")
    list_display_links = ("id",)
    list_filter = (
        state_filter(Job),
        "kind",
        value_filter("tenant_key", "tenant key"),
        value_filter("last_error_class", "last error class"),
    )
    # Job id, kind, subject (the site's hook below), error class and code; searching the
    # text of errors is reading it: only with view_error_detail (error_search_fields).
    search_fields = (
        "=id",
        "=subject_id",
        "kind",
        "lease_owner",
        "last_error_class",
        "last_error_code",
    )
    error_search_fields = ("last_error_type", "last_error_message")
    readonly_fields = (
        "subject",
        "tries",
        "state_word",
        "error_class",
        "error_message",
        "error_and_traceback",
        *[f.name for f in Job._meta.fields],
    )
    # What an operator triages first (state, error, then the attempts timeline and the
    # actions above the form); the engine's bookkeeping is folded and comes last
    # (admin/jobs/job/change_form.html renders folded fieldsets after the inlines).
    fieldsets = [
        (None, {"fields": ("state_word", "subject", "kind", "tries")}),
        ("Error", {"fields": ("error_class", "error_message")}),
        (
            "Times",
            {
                "classes": ("jobs-after",),
                "fields": (
                    "created_at",
                    "started_at",
                    "next_attempt_at",
                    "finished_at",
                    "updated_at",
                ),
            },
        ),
        (
            "Engine detail",
            {
                "classes": ("collapse",),
                "fields": (
                    "id",
                    "subject_type",
                    "subject_id",
                    "output_revision",
                    "tenant_key",
                    "params",
                    "version",
                    "attempts",
                    "max_attempts",
                    "lease_owner",
                    "lease_expires_at",
                    "enqueued_for",
                    "last_error_class",
                    "last_error_code",
                    "last_error_detail",
                ),
            },
        ),
    ]
    inlines = [AttemptInline, JobEventInline, ArtifactInline, EffectInline]

    def get_fieldsets(self, request, obj=None):
        fieldsets = super().get_fieldsets(request, obj)
        if not can_view_error_detail(request):
            return fieldsets
        shown = []
        for name, options in fieldsets:
            if name == "Error":
                options = {**options, "fields": (*options["fields"], "error_and_traceback")}
            shown.append((name, options))
        return shown

    def get_search_fields(self, request):
        fields = super().get_search_fields(request)
        if can_view_error_detail(request):
            fields = (*fields, *self.error_search_fields)
        return fields

    @admin.display(description="error and traceback")
    def error_and_traceback(self, obj):
        if not obj.last_error_class:  # the job succeeded since: its last error is history
            return "—"
        return error_block(obj.last_error_type, obj.last_error_message, obj.last_error_traceback)

    def get_urls(self):
        """The operations console lives with the jobs list: no URL include needed for it."""
        from jobs.views import dashboard_view

        dashboard = self.admin_site.admin_view(dashboard_view)
        return [path("dashboard/", dashboard, name="jobs_job_dashboard"), *super().get_urls()]

    def has_operate_permission(self, request) -> bool:
        return request.user.has_perm("jobs.change_job")

    def get_changelist_instance(self, request):
        changelist = super().get_changelist_instance(request)
        self._labels = subject_labels(changelist.result_list)  # one query per subject type
        return changelist

    def get_search_results(self, request, queryset, search_term):
        found, distinct = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        if term:
            for subject_type, hooks in SUBJECTS.items():
                ids = [str(i) for i in hooks.search(term)]
                if ids:
                    found = found | queryset.filter(subject_type=subject_type, subject_id__in=ids)
        return found, distinct

    @admin.display(description="subject")
    def subject(self, obj):
        label = getattr(self, "_labels", {}).get((obj.subject_type, obj.subject_id))
        if label is None and obj.subject_type in SUBJECTS:
            label = SUBJECTS[obj.subject_type].labels([obj.subject_id]).get(obj.subject_id)
        text = label or f"{obj.subject_type}:{obj.subject_id}"
        url = subject_admin_url(obj.subject_type, obj.subject_id)
        revision = f" r{obj.output_revision}"
        if url is None:
            return text + revision
        return format_html('<a href="{}">{}</a>{}', url, text, revision)

    @admin.display(description="subject and kind", ordering="kind")
    def subject_and_kind(self, obj):
        # One column for both keeps the list readable at 1366 px beside the filters.
        return format_html('{}<br><span class="jobs-kind">{}</span>', self.subject(obj), obj.kind)

    @admin.display(description="state", ordering="state")
    def state_word(self, obj):
        return _state(obj)

    @admin.display(description="error class")
    def error_class(self, obj):
        return error_of(obj)[0]

    @admin.display(description="error message")
    def error_message(self, obj):
        message = error_of(obj)[1]
        if not message:
            return "—"
        return format_html('<span class="jobs-error">{}</span>', message)

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj):
        return _when(obj.updated_at)

    @admin.display(description="tries")
    def tries(self, obj):
        return f"{obj.attempts} of {obj.max_attempts}"


@admin.register(Attempt)
class AttemptAdmin(EngineAdmin):
    list_display = (
        "id",
        "job",
        "number",
        "worker",
        "outcome",
        "error_class",
        "error_code",
        "started_at",
    )
    list_filter = (value_filter("outcome", "outcome"), value_filter("error_class", "error class"))
    search_fields = ("worker", "=job__id", "error_code", "error_type")
    readonly_fields = ["error", *[f.name for f in Attempt._meta.fields]]
    error_detail_fields = ("error_message", "error_traceback")

    def get_fields(self, request, obj=None):
        fields = [f.name for f in Attempt._meta.fields]
        if can_view_error_detail(request):
            return [f for f in fields if f not in self.error_detail_fields] + ["error"]
        return [f for f in fields if f not in self.error_detail_fields]

    def get_search_fields(self, request):
        fields = super().get_search_fields(request)
        if can_view_error_detail(request):
            fields = (*fields, "error_message")
        return fields

    @admin.display(description="error and traceback")
    def error(self, obj):
        return error_block(obj.error_type, obj.error_message, obj.error_traceback)


class EffectEventInline(ReadOnlyInline):
    model = EffectEvent
    fk_name = "effect"
    verbose_name_plural = "History (sends and operator actions, oldest first)"
    fields = readonly_fields = (
        "at",
        "action",
        "attempt",
        "actor",
        "outcome",
        "error_class",
        "error_code",
        "note",
    )


@admin.register(Effect)
class EffectAdmin(LastErrorColumn, EngineAdmin):
    """The ledger: effects (one row per outcome) above, their sends and actions inline.

    The changelist opens with a per-provider table that keeps effects and sends
    apart: resends under the same key are expected under faults, duplicate
    effects must stay 0.
    """

    operations = EFFECT_OPERATIONS
    actions = [_operation_action(op) for op in EFFECT_OPERATIONS.values()]
    list_display = (
        "effect_id",
        "provider_word",
        "state_word",
        "attempts",
        "last_error",
        "reason",
        "applied_at",
    )
    list_filter = (
        state_filter(Effect),
        "provider",
        value_filter("last_error_class", "last error class"),
    )
    # Effect id, identity, key, provider reference, job id; recipient username below.
    # (No search_help_text: its aria-describedby on the icon-labelled box fails axe.)
    search_fields = ("=id", "effect_id", "idempotency_key", "provider_ref", "=job__id")

    def get_search_results(self, request, queryset, search_term):
        found, distinct = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        if term:
            from django.contrib.auth import get_user_model

            User = get_user_model()
            ids = User.objects.filter(**{f"{User.USERNAME_FIELD}__iexact": term}).values_list(
                "pk", flat=True
            )
            found = found | queryset.filter(recipient__in=[str(i) for i in ids])
        return found, distinct

    readonly_fields = (
        "job_link",
        "state_word",
        "recipient_who",
        *[f.name for f in Effect._meta.fields],
    )
    inlines = [EffectEventInline]
    # State, reason and recipient first, the history (events) right after them; the
    # ledger's bookkeeping is folded and comes last.
    fieldsets = [
        (None, {"fields": ("state_word", "reason", "recipient_who", "provider", "job_link")}),
        (
            "Last error",
            {"classes": ("jobs-after",), "fields": ("last_error_class", "last_error_code")},
        ),
        (
            "Times",
            {
                "classes": ("jobs-after",),
                "fields": ("created_at", "updated_at", "next_attempt_at", "applied_at"),
            },
        ),
        (
            "Ledger detail",
            {
                "classes": ("collapse",),
                "fields": (
                    "id",
                    "effect_id",
                    "name",
                    "recipient",
                    "idempotency_key",
                    "provider_ref",
                    "data",
                    "version",
                    "attempts",
                    "max_attempts",
                    "lease_owner",
                    "lease_expires_at",
                    "enqueued_for",
                ),
            },
        ),
    ]

    @admin.display(description="state", ordering="state")
    def state_word(self, obj):
        return _state(obj)

    @admin.display(description="provider", ordering="provider")
    def provider_word(self, obj):
        return words.provider_tag(obj.provider)

    @admin.display(description="recipient")
    def recipient_who(self, obj):
        from django.contrib.auth import get_user_model

        User = get_user_model()
        user = User.objects.filter(pk=obj.recipient).first() if obj.recipient.isdigit() else None
        if user is None:
            return f"user {obj.recipient} (no such account now)"
        name = user.get_full_name() if hasattr(user, "get_full_name") else ""
        return f"{user.get_username()}{f' ({name})' if name else ''} · user {obj.recipient}"

    def has_operate_permission(self, request) -> bool:
        return request.user.has_perm("jobs.change_effect")

    def changelist_view(self, request, extra_context=None):
        providers = stats.collect_providers()
        # The states in the admin's words with the engine's name beside them, as elsewhere.
        summary = [
            (
                name,
                {
                    **p,
                    "states": [
                        (words.state_tag(s, effect=True), n) for s, n in p["by_state"].items()
                    ],
                },
            )
            for name, p in sorted(providers.items())
        ]
        extra_context = {**(extra_context or {}), "provider_summary": summary}
        return super().changelist_view(request, extra_context=extra_context)

    @admin.display(description="job")
    def job_link(self, obj):
        url = reverse("admin:jobs_job_change", args=[obj.job_id])
        return format_html('<a href="{}">job {}</a>', url, obj.job_id)


@admin.register(EffectEvent)
class EffectEventAdmin(EngineAdmin):
    list_display = ("at", "effect", "provider", "action", "attempt", "actor", "outcome")
    list_filter = (
        "provider",
        "action",
        value_filter("outcome", "outcome"),
        value_filter("error_class", "error class"),
    )
    search_fields = ("effect__effect_id", "actor")
    readonly_fields = [f.name for f in EffectEvent._meta.fields]


@admin.register(Artifact)
class ArtifactAdmin(EngineAdmin):
    """Published artifacts: the file the row names, its sha256, and whether it is lost (why)."""

    list_display = (
        "key",
        "job",
        "state",
        "size",
        "content_type",
        "sha256",
        "verified_at",
        "rewrites",
        "lost_reason",
    )
    list_filter = ("state",)
    readonly_fields = [f.name for f in Artifact._meta.fields]
    actions = ["verify"]

    @admin.action(description="Verify stored bytes against sha256", permissions=["operate"])
    def verify(self, request, queryset):
        bad, unread = [], []
        for artifact in queryset:
            try:
                artifacts.verify(artifact)
            except artifacts.ArtifactLost:
                bad.append(f"{artifact.key} (lost: {artifact.lost_reason or 'no reason recorded'})")
                self.log_change(request, artifact, "Verified: lost")
            except ArtifactCorrupt:
                bad.append(artifact.key)
                self.log_change(request, artifact, "Verified: missing or corrupt")
            except TemporaryFailure as exc:  # no verdict on the bytes: nothing recorded
                unread.append(f"{artifact.key} ({exc.detail or exc.code})")
            else:
                self.log_change(request, artifact, "Verified: intact")
        if unread:
            self.message_user(
                request,
                f"Could not be read now, so not judged (the storage failed; try again once "
                f"it answers): {', '.join(unread)}",
                messages.WARNING,
            )
        if bad:
            self.message_user(request, f"Missing or corrupt: {', '.join(bad)}", messages.ERROR)
        elif not unread:
            self.message_user(request, f"{queryset.count()} artifact(s) intact.", messages.SUCCESS)


@admin.register(Notice)
class NoticeAdmin(EngineAdmin):
    list_display = ("id", "recipient", "title", "created_at", "read_at")
    readonly_fields = [f.name for f in Notice._meta.fields]


# --- django-q2's own pages: operators read them; changing takes the change permission -------


def _guard_resubmit() -> None:
    """django-q2's "resubmit" list action has no permission of its own: require "change"."""
    from django_q import admin as q_admin
    from django_q.models import Failure, Success

    for model, base in ((Success, q_admin.TaskAdmin), (Failure, q_admin.FailAdmin)):

        class Guarded(base):
            def get_actions(self, request):
                found = super().get_actions(request)
                if not self.has_change_permission(request):
                    found.pop("resubmit_task", None)
                return found

        if admin.site.is_registered(model):
            admin.site.unregister(model)
            admin.site.register(model, Guarded)


_guard_resubmit()

# The flow rules' admin (issue 22) lives in its own module.
from jobs import flow_admin  # noqa: E402, F401
