"""Operator screens: jobs with their attempts and effects, read-only engine state.

Nobody edits engine fields by hand; the actions go through the same CAS
transitions the workers use.
"""

from __future__ import annotations

from django.contrib import admin, messages

from jobs import artifacts, ledger, services, stats
from jobs.exceptions import ArtifactCorrupt
from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, Notice


class ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class AttemptInline(ReadOnlyInline):
    model = Attempt
    fields = readonly_fields = (
        "number",
        "worker",
        "started_at",
        "finished_at",
        "outcome",
        "error_class",
        "error_code",
        "retry_delay_seconds",
    )


class EffectInline(ReadOnlyInline):
    model = Effect
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
    fields = readonly_fields = ("key", "sha256", "size", "content_type", "created_at", "rewrites")


def _report(modeladmin, request, done: int, total: int, verb: str) -> None:
    level = messages.SUCCESS if done == total else messages.WARNING
    modeladmin.message_user(request, f"{verb} {done} of {total} selected.", level)


class EngineAdmin(admin.ModelAdmin):
    """Everything read-only: state changes only through actions."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Job)
class JobAdmin(EngineAdmin):
    list_display = (
        "id",
        "kind",
        "tenant_key",
        "subject_type",
        "subject_id",
        "output_revision",
        "state",
        "attempts",
        "max_attempts",
        "last_error_class",
        "last_error_code",
        "updated_at",
    )
    list_filter = ("state", "kind", "tenant_key", "last_error_class")
    search_fields = ("=id", "subject_id", "lease_owner")
    readonly_fields = [f.name for f in Job._meta.fields]
    inlines = [AttemptInline, ArtifactInline, EffectInline]
    actions = ["retry_now", "cancel", "requeue"]

    def get_urls(self):
        """The dashboard lives with the jobs list: no URL include needed for it."""
        from django.urls import path

        from jobs.views import dashboard_view

        dashboard = self.admin_site.admin_view(dashboard_view)
        return [path("dashboard/", dashboard, name="jobs_job_dashboard"), *super().get_urls()]

    @admin.action(description="Retry now (waiting jobs)")
    def retry_now(self, request, queryset):
        _report(
            self,
            request,
            sum(services.retry_job_now(j) for j in queryset),
            queryset.count(),
            "Retried",
        )

    @admin.action(description="Cancel (queued or waiting jobs)")
    def cancel(self, request, queryset):
        _report(
            self,
            request,
            sum(services.cancel_job(j) for j in queryset),
            queryset.count(),
            "Cancelled",
        )

    @admin.action(description="Requeue (failed or dead jobs)")
    def requeue(self, request, queryset):
        _report(
            self,
            request,
            sum(services.requeue_job(j) for j in queryset),
            queryset.count(),
            "Requeued",
        )


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
    list_filter = ("outcome", "error_class")
    readonly_fields = [f.name for f in Attempt._meta.fields]


class EffectEventInline(ReadOnlyInline):
    model = EffectEvent
    show_change_link = False
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


def _operator(request) -> str:
    return request.user.get_username() or f"user-{request.user.pk}"


@admin.register(Effect)
class EffectAdmin(EngineAdmin):
    """The ledger: effects (one row per outcome) above, their sends and actions inline.

    The changelist opens with a per-provider table that keeps effects and sends
    apart: resends under the same key are expected under faults, duplicate
    effects must stay 0.
    """

    list_display = (
        "effect_id",
        "provider",
        "state",
        "attempts",
        "last_error_class",
        "last_error_code",
        "reason",
        "provider_ref",
        "applied_at",
    )
    list_filter = ("state", "provider", "last_error_class")
    search_fields = ("effect_id", "idempotency_key", "provider_ref")
    readonly_fields = [f.name for f in Effect._meta.fields]
    inlines = [EffectEventInline]
    actions = ["recheck_and_release", "mark_sent", "send_again"]

    def changelist_view(self, request, extra_context=None):
        providers = stats.collect_providers()
        extra_context = {**(extra_context or {}), "provider_summary": sorted(providers.items())}
        return super().changelist_view(request, extra_context=extra_context)

    # Each action changes the rows and enqueues their messages, then returns: a worker sends.
    @admin.action(description="Re-check authorization and release (withheld effects)")
    def recheck_and_release(self, request, queryset):
        operator = _operator(request)
        done = sum(
            services.recheck_and_release(e, operator=operator)
            for e in queryset.select_related("job")
        )
        _report(self, request, done, queryset.count(), "Queued for a recheck:")

    @admin.action(description="Mark sent: delivery confirmed out of band (needs review)")
    def mark_sent(self, request, queryset):
        operator = _operator(request)
        done = sum(
            ledger.mark_sent(e, operator=operator, note="admin action")
            for e in queryset.select_related("job")
        )
        _report(self, request, done, queryset.count(), "Marked sent")

    @admin.action(description="Send again (needs review; e-mail may arrive twice)")
    def send_again(self, request, queryset):
        operator = _operator(request)
        done = sum(
            ledger.send_again(e, operator=operator, note="admin action")
            for e in queryset.select_related("job")
        )
        _report(self, request, done, queryset.count(), "Queued to send again:")


@admin.register(EffectEvent)
class EffectEventAdmin(EngineAdmin):
    list_display = ("at", "effect", "provider", "action", "attempt", "actor", "outcome")
    list_filter = ("provider", "action", "outcome", "error_class")
    search_fields = ("effect__effect_id", "actor")
    readonly_fields = [f.name for f in EffectEvent._meta.fields]


@admin.register(Artifact)
class ArtifactAdmin(EngineAdmin):
    list_display = ("key", "job", "size", "content_type", "sha256", "verified_at", "rewrites")
    readonly_fields = [f.name for f in Artifact._meta.fields]
    actions = ["verify"]

    @admin.action(description="Verify stored bytes against sha256")
    def verify(self, request, queryset):
        bad = []
        for artifact in queryset:
            try:
                artifacts.verify(artifact)
            except ArtifactCorrupt:
                bad.append(artifact.key)
        if bad:
            self.message_user(request, f"Missing or corrupt: {', '.join(bad)}", messages.ERROR)
        else:
            self.message_user(request, f"{queryset.count()} artifact(s) intact.", messages.SUCCESS)


@admin.register(Notice)
class NoticeAdmin(EngineAdmin):
    list_display = ("id", "recipient", "title", "created_at", "read_at")
    readonly_fields = [f.name for f in Notice._meta.fields]
