"""The jobs list and a job's page: state, error, attempts timeline, what it published.

A job's subject is the site's (a permit): ``jobs.hooks`` says how to name and find it,
so searching the list for a permit reference finds its report jobs.
"""

from __future__ import annotations

from django.apps import apps
from django.contrib import admin
from django.db.models import Case, F, IntegerField, Q, QuerySet, Sum, Value, When, Window
from django.urls import NoReverseMatch, path, reverse
from django.utils.html import format_html, format_html_join

from jobs.engine import groups
from jobs.hooks import SUBJECTS, subject_labels
from jobs.models import Artifact, Attempt, Effect, Job, JobEvent, JobGroup, JobStep
from jobs.ops import causes, redrive_views, sequence_views, words
from jobs.ops.admin_common import (
    EngineAdmin,
    LastErrorColumn,
    ReadOnlyInline,
    shown_time,
    state_filter,
    state_tag_of,
    value_filter,
)
from jobs.ops.console import error_of
from jobs.ops.error_detail import can_view_error_detail, error_block, kind_redacts, shown_detail
from jobs.ops.operations import JOB_OPERATIONS, list_actions
from jobs.ops.views import dashboard_view


def subject_admin_url(subject_type: str, subject_id: str) -> str | None:
    """The subject's admin page when its model is registered there (by app label and model)."""
    if subject_type in (groups.FOLLOW_UP_SUBJECT, groups.JOIN_SUBJECT):
        return None  # "<parent id>.<name>" is no row's key: the chain line links the parent
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


def _job_link(job_id: int) -> str:
    url = reverse("admin:jobs_job_change", args=[job_id])
    return format_html('<a href="{}">job {}</a>', url, job_id)


def numbered_attempts(queryset: QuerySet) -> QuerySet:
    """Attempts with ``try_no``: the job's tries counted in order (jobs requeued before
    requeues grew the budget instead of resetting the count repeat a ``number``;
    ``try_no`` never does)."""
    tried = Case(When(number__gt=0, then=Value(1)), default=Value(0), output_field=IntegerField())
    return queryset.annotate(
        try_no=Window(
            Sum(tried), partition_by=[F("job_id")], order_by=[F("started_at").asc(), F("id").asc()]
        )
    )


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
        else:  # the detail is the raiser's text: an error detail like the message
            fields.remove("error_detail")
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
        return shown_time(obj.started_at)

    @admin.display(description="finished")
    def finished(self, obj):
        return shown_time(obj.finished_at)

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
        shown = shown_detail(job.kind, job.last_error_detail, allowed=True)  # get_fields asked
        return shown if obj.error_class and last and shown else "—"


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
        return state_tag_of(obj)


class ArtifactInline(ReadOnlyInline):
    model = Artifact
    fk_name = "job"
    fields = readonly_fields = ("key", "sha256", "size", "content_type", "created_at", "rewrites")


class StepInline(ReadOnlyInline):
    """The job's durable steps (``ctx.step``): which attempt did each, and when. The
    outputs stay off the page: they are the handler's references, read by its code."""

    model = JobStep
    fk_name = "job"
    fields = readonly_fields = ("name", "attempt", "worker", "started_at", "took")
    show_change_link = False
    verbose_name_plural = "Steps (each done once; later attempts reuse its output)"

    @admin.display(description="took")
    def took(self, obj):
        return words.duration(obj.finished_at - obj.started_at)


class FollowUpInline(ReadOnlyInline):
    """The jobs this job's publish requested (``jobs.then``, group children, joins)."""

    model = Job
    fk_name = "parent"
    fields = readonly_fields = ("name", "state_word", "finished_at")  # its kind heads the row
    show_change_link = True
    verbose_name = "follow-up"
    verbose_name_plural = "Follow-ups (requested when this job succeeded)"

    def get_queryset(self, request):
        return super().get_queryset(request).order_by("pk")  # in the order requested

    @admin.display(description="name")
    def name(self, obj):
        return groups.follow_up_name(obj)

    @admin.display(description="state")
    def state_word(self, obj):
        return state_tag_of(obj)


@admin.register(Job)
class JobAdmin(LastErrorColumn, EngineAdmin):
    operations = JOB_OPERATIONS
    actions = list_actions(JOB_OPERATIONS)
    list_display = (
        "id",
        "subject_and_kind",
        "state_word",
        "queue_column",
        "priority_column",
        "progress_column",
        "tries",
        "last_error",
        "updated",
    )
    list_display_links = ("id",)
    list_filter = (
        state_filter(Job),
        "kind",
        value_filter("queue", "queue"),
        "priority",
        value_filter("tenant_key", "tenant key"),
        value_filter("last_error_class", "last error class"),
    )
    # Job id, kind, subject (the site's hook below), error class and code; searching the
    # text of errors is reading it: only with view_error_detail (error_search_fields).
    search_fields = (
        "=id",
        "=uid",  # the job's part of an object name or key (jobs.identity)
        "=subject_id",
        "kind",
        "lease_owner",
        "last_error_class",
        "last_error_code",
    )
    error_search_fields = ("last_error_type", "last_error_message")
    readonly_fields = (
        "subject",
        "progress",
        "debounced",
        "chain",
        "tries",
        "state_word",
        "cause",
        "error_class",
        "error_message",
        "error_and_traceback",
        *[f.name for f in Job._meta.fields],
    )
    # What an operator triages first (state, error, then the attempts timeline and the
    # actions above the form); the engine's bookkeeping is folded and comes last
    # (admin/jobs/job/change_form.html renders folded fieldsets after the inlines).
    fieldsets = [
        (
            None,
            {
                "fields": (
                    "state_word",
                    "subject",
                    "kind",
                    ("queue", "priority"),
                    "tries",
                    "progress",
                    "debounced",
                    "chain",
                )
            },
        ),
        ("Error", {"fields": ("cause", "error_class", "error_message")}),
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
                    "uid",
                    "keys_from_id",
                    "subject_type",
                    "subject_id",
                    "output_revision",
                    "tenant_key",
                    "params",
                    "debounce_key",
                    "debounce_until",
                    "debounce_replaced",
                    "version",
                    "attempts",
                    "held_looks",
                    "deferred_by",
                    "max_attempts",
                    "lease_owner",
                    "lease_expires_at",
                    "last_error_class",
                    "last_error_code",
                    "last_error_detail",
                ),
            },
        ),
    ]
    inlines = [
        AttemptInline,
        StepInline,
        FollowUpInline,
        JobEventInline,
        ArtifactInline,
        EffectInline,
    ]

    def get_fieldsets(self, request, obj=None):
        fieldsets = super().get_fieldsets(request, obj)
        detail = can_view_error_detail(request)
        shown = []
        for name, options in fieldsets:
            if name == "Error" and detail:
                options = {**options, "fields": (*options["fields"], "error_and_traceback")}
            elif name == "Engine detail" and not (detail and obj and not kind_redacts(obj.kind)):
                kept = tuple(f for f in options["fields"] if f != "last_error_detail")
                options = {**options, "fields": kept}
            elif name is None:
                hidden = {"chain"} if not (obj and self._in_a_chain(obj)) else set()
                if not (obj and (obj.debounce_key or obj.debounce_replaced)):
                    hidden.add("debounced")
                options = {
                    **options,
                    "fields": tuple(f for f in options["fields"] if f not in hidden),
                }
            shown.append((name, options))
        return shown

    @staticmethod
    def _in_a_chain(obj: Job) -> bool:
        if obj.parent_id is not None or obj.group_id is not None:
            return True
        return JobGroup.objects.filter(Q(join=obj) | Q(parent=obj)).exists()

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
        dashboard = self.admin_site.admin_view(dashboard_view)
        return [
            path("dashboard/", dashboard, name="jobs_job_dashboard"),
            *redrive_views.urls(self.admin_site),
            *sequence_views.urls(self.admin_site),
            *super().get_urls(),
        ]

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
        if not getattr(obj, "_on_change_page", False):
            return format_html('<a href="{}">{}</a>{}', url, text, revision)
        if not (obj.last_error_class and causes.subject_fix_helps(obj)):
            # No failure, or one whose cause is not in the subject: the link cannot help.
            return format_html('<a href="{}">{}</a>{}', url, text, revision)
        # On the job's page: the way to the cause and back (saving the subject returns here).
        return format_html(
            '<a href="{}">{}</a>{} · <a href="{}?_job={}" id="fix-subject">Fix the subject</a>',
            url,
            text,
            revision,
            url,
            obj.pk,
        )

    @admin.display(description="progress")
    def progress(self, obj):
        """What the handler last said of its progress (``ctx.progress``), when it did; an
        open page keeps it current (``jobs/live.js`` polls the follow URL)."""
        if obj.progress_at is None:
            return "—"
        return f"{words.job_progress(obj)}, at {shown_time(obj.progress_at)}"

    @admin.display(description="debounced")
    def debounced(self, obj):
        """How many requests replaced this debounced job's params before its first claim
        (latest wins), and, while its window is open, when it is due at the latest."""
        replaced = obj.debounce_replaced
        said = f"{replaced} earlier request{'s' if replaced != 1 else ''} replaced (latest wins)"
        if obj.state == Job.State.QUEUED and obj.attempts == 0 and obj.debounce_until:
            said += f"; window open, due by {shown_time(obj.debounce_until)} at the latest"
        return said

    @admin.display(description="progress")
    def progress_column(self, obj):
        return words.job_progress(obj)

    @admin.display(description="queue", ordering="queue")
    def queue_column(self, obj):
        return obj.queue

    @admin.display(description="priority", ordering="-priority")
    def priority_column(self, obj):
        return obj.priority

    @admin.display(description="chain")
    def chain(self, obj):
        """Where the job stands in a chain or group: who requested it, its group's count,
        or the group it joins (docs/app/chains.md)."""
        parts = []
        if obj.parent_id is not None:
            parts.append(format_html("requested by {}", _job_link(obj.parent_id)))
        if obj.group_id is not None:
            group = obj.group
            counted = f"counted {obj.group_outcome}" if obj.group_outcome else "not ended yet"
            parts.append(
                format_html(
                    "child of group {} ({} of {} ended; this one {})",
                    group.name,
                    group.ended,
                    group.size,
                    counted,
                )
            )
        for group in JobGroup.objects.filter(parent=obj).order_by("pk"):
            join = _job_link(group.join_id) if group.join_id else "not requested yet"
            parts.append(
                format_html(
                    "requested group {}: {} of {} ended, {} did not succeed; its join: {}",
                    group.name,
                    group.ended,
                    group.size,
                    group.not_succeeded,
                    join,
                )
            )
        joined = JobGroup.objects.filter(join=obj).first()
        if joined is not None:
            parts.append(
                format_html(
                    "the join of group {}: {} children, {} did not succeed",
                    joined.name,
                    joined.size,
                    joined.not_succeeded,
                )
            )
        if not parts:
            return "—"
        return format_html_join("; ", "{}", ((p,) for p in parts))

    @admin.display(description="subject and kind", ordering="kind")
    def subject_and_kind(self, obj):
        # One column for both keeps the list readable at 1366 px beside the filters.
        return format_html('{}<br><span class="jobs-kind">{}</span>', self.subject(obj), obj.kind)

    @admin.display(description="state", ordering="state")
    def state_word(self, obj):
        held = words.held_words(obj)
        if not held:
            return state_tag_of(obj)
        return format_html('{}<br><span class="jobs-held">{}</span>', state_tag_of(obj), held)

    @admin.display(description="error class")
    def error_class(self, obj):
        return error_of(obj)[0]

    @admin.display(description="cause")
    def cause(self, obj):
        """What failed, in words (``jobs.ops.causes``), and the one thing that helps."""
        words_ = causes.plain_words(obj)
        if not words_:
            return "—"
        found = causes.cause_of(obj)
        if found is not None and found.fix:
            return format_html(
                '<span class="jobs-cause">{}</span><br><span class="jobs-cause__fix">{}</span>',
                words_,
                found.fix,
            )
        return format_html('<span class="jobs-cause">{}</span>', words_)

    def get_object(self, request, object_id, from_field=None):
        obj = super().get_object(request, object_id, from_field)
        if obj is not None:
            # Kept on this request's object (the ModelAdmin is shared by every request):
            # the display methods below get the object, not the request.
            obj._viewer_detail = can_view_error_detail(request)
            obj._on_change_page = True
        return obj

    @admin.display(description="error message")
    def error_message(self, obj):
        message = error_of(obj, detail=getattr(obj, "_viewer_detail", False))[1]
        if not message:
            return "—"
        return format_html('<span class="jobs-error">{}</span>', message)

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj):
        return shown_time(obj.updated_at)

    @admin.display(description="tries")
    def tries(self, obj):
        # Held looks: claims that found it held back by a rule (no attempt spent, no row).
        held = f", held back {obj.held_looks} times" if obj.held_looks else ""
        by = f" (last by {obj.deferred_by})" if obj.held_looks and obj.deferred_by else ""
        return f"{obj.attempts} of {obj.max_attempts}{held}{by}"


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
