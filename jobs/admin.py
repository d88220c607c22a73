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

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from django.apps import apps
from django.contrib import admin, messages
from django.contrib.admin.models import LogEntry
from django.core.exceptions import PermissionDenied
from django.db.models import Case, F, IntegerField, Sum, Value, When, Window
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import NoReverseMatch, path, reverse
from django.utils import formats, timezone
from django.utils.html import format_html
from django.views.decorators.http import require_POST

from jobs import artifacts, ledger, services, stats
from jobs.exceptions import ArtifactCorrupt
from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, Notice

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
            lambda job, operator: services.retry_job_now(job),
        ),
        Operation(
            "cancel",
            "Cancel",
            "Cancelled",
            "Stop it before it runs; it will not be tried again.",
            (JobState.QUEUED, JobState.RETRY_WAIT),
            lambda job, operator: services.cancel_job(job),
        ),
        Operation(
            "requeue",
            "Requeue",
            "Requeued",
            "Give it a fresh attempt budget and queue it again (earlier attempts stay listed).",
            (JobState.FAILED, JobState.DEAD),
            lambda job, operator: services.requeue_job(job),
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


def _operator(request) -> str:
    return request.user.get_username() or f"user-{request.user.pk}"


def _states(op: Operation) -> str:
    return " or ".join(s.replace("_", " ") for s in op.states)


def _describe(obj) -> str:
    return f"job {obj.pk}" if isinstance(obj, Job) else f"effect {obj}"


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

    def operate_many(self, request, queryset, op: Operation) -> None:
        objs = list(queryset)
        refused = []
        for obj in objs:
            won, why = self.operate(request, obj, op)
            if not won:
                refused.append(why)
        done = len(objs) - len(refused)
        text = f"{op.done} {done} of {len(objs)} selected."
        if refused:
            text += (
                " Not done: " + "; ".join(refused[:5]) + (" …" if len(refused) > 5 else "") + "."
            )
        self.message_user(request, text, messages.SUCCESS if not refused else messages.WARNING)

    def _url_name(self, view: str) -> str:
        return f"{self.opts.app_label}_{self.opts.model_name}_{view}"

    def get_urls(self):
        return [
            path(
                "<path:object_id>/operate/<str:operation>/",
                self.admin_site.admin_view(require_POST(self.operate_view)),
                name=self._url_name("operate"),
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
        """POST from a change page's button: run one operation, then back to the page."""
        op = self.operations.get(operation)
        if op is None:
            raise Http404("No such operation")
        if not self.has_operate_permission(request):
            raise PermissionDenied
        obj = get_object_or_404(self.get_queryset(request), pk=self._pk(object_id))
        won, why = self.operate(request, obj, op)
        if won:
            self.message_user(request, f"{op.label}: done for {_describe(obj)}.", messages.SUCCESS)
        else:
            self.message_user(request, f"{op.label}: not done, {why}.", messages.WARNING)
        return HttpResponseRedirect(reverse(f"admin:{self._url_name('change')}", args=[obj.pk]))

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
            extra["operator_log"] = LogEntry.objects.filter(
                content_type__app_label=self.opts.app_label,
                content_type__model=self.opts.model_name,
                object_id=str(obj.pk),
            ).select_related("user")[:10]
        return super().change_view(request, object_id, form_url, extra_context=extra)


def _operation_action(op: Operation):
    def action(modeladmin, request, queryset):
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
    """Attempts with ``try_no``: the job's tries counted across requeues (a requeue resets
    the budget, so ``number`` starts again at 1; ``try_no`` does not)."""
    tried = Case(When(number__gt=0, then=Value(1)), default=Value(0), output_field=IntegerField())
    return queryset.annotate(
        try_no=Window(
            Sum(tried), partition_by=[F("job_id")], order_by=[F("started_at").asc(), F("id").asc()]
        )
    )


def _when(at) -> str:
    """A compact local time with seconds: lists and history rows compare instants."""
    return "—" if at is None else formats.date_format(timezone.localtime(at), "Y-m-d H:i:s")


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
        # Attempt.number restarts at 1 after a requeue (a fresh budget); "try" does not.
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
        "provider",
        "state",
        "attempts",
        "reason",
        "applied_at",
    )


class ArtifactInline(ReadOnlyInline):
    model = Artifact
    fk_name = "job"
    fields = readonly_fields = ("key", "sha256", "size", "content_type", "created_at", "rewrites")


class EngineAdmin(OperableAdmin):
    """Everything read-only: state changes only through operations."""

    class Media:
        css = {"all": ["jobs/admin.css"]}

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


class LastErrorColumn:
    """A list column for rows with ``last_error_class``/``last_error_code``."""

    @admin.display(description="last error", ordering="last_error_class")
    def last_error(self, obj):
        if not obj.last_error_class:
            return "—"
        return " · ".join(x for x in (obj.last_error_class, obj.last_error_code) if x)


def _state(obj) -> str:
    return format_html('<span class="jobs-state jobs-state--{}">{}</span>', obj.state, obj.state)


@admin.register(Job)
class JobAdmin(LastErrorColumn, EngineAdmin):
    operations = JOB_OPERATIONS
    actions = [_operation_action(op) for op in JOB_OPERATIONS.values()]
    list_display = ("id", "subject_and_kind", "state_word", "tries", "last_error", "updated")
    list_display_links = ("id",)
    list_filter = (
        "state",
        "kind",
        value_filter("tenant_key", "tenant key"),
        value_filter("last_error_class", "last error class"),
    )
    search_fields = ("=id", "=subject_id", "kind", "lease_owner")
    readonly_fields = ("subject", "tries", *[f.name for f in Job._meta.fields])
    fieldsets = [
        (None, {"fields": ("subject", "kind", "output_revision", "tenant_key", "state", "tries")}),
        ("Last error", {"fields": ("last_error_class", "last_error_code", "last_error_detail")}),
        (
            "Times",
            {
                "fields": (
                    "created_at",
                    "started_at",
                    "next_attempt_at",
                    "finished_at",
                    "updated_at",
                )
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
                    "params",
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
    inlines = [AttemptInline, ArtifactInline, EffectInline]

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
    search_fields = ("worker", "=job__id")
    readonly_fields = [f.name for f in Attempt._meta.fields]


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
        "provider",
        "state",
        "attempts",
        "last_error",
        "reason",
        "applied_at",
    )
    list_filter = ("state", "provider", value_filter("last_error_class", "last error class"))
    search_fields = ("effect_id", "idempotency_key", "provider_ref", "=job__id")
    readonly_fields = ("job_link", *[f.name for f in Effect._meta.fields])
    inlines = [EffectEventInline]

    def has_operate_permission(self, request) -> bool:
        return request.user.has_perm("jobs.change_effect")

    def changelist_view(self, request, extra_context=None):
        providers = stats.collect_providers()
        extra_context = {**(extra_context or {}), "provider_summary": sorted(providers.items())}
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
    list_display = ("key", "job", "size", "content_type", "sha256", "verified_at", "rewrites")
    readonly_fields = [f.name for f in Artifact._meta.fields]
    actions = ["verify"]

    @admin.action(description="Verify stored bytes against sha256", permissions=["operate"])
    def verify(self, request, queryset):
        bad = []
        for artifact in queryset:
            try:
                artifacts.verify(artifact)
            except ArtifactCorrupt:
                bad.append(artifact.key)
                self.log_change(request, artifact, "Verified: missing or corrupt")
            else:
                self.log_change(request, artifact, "Verified: intact")
        if bad:
            self.message_user(request, f"Missing or corrupt: {', '.join(bad)}", messages.ERROR)
        else:
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
