"""The ledger in the admin: effects (one row per outcome), their sends and operator actions.

An effect's page shows its state, reason and recipient, then its history; the list
opens with a per-provider table that keeps effects and sends apart.
"""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.urls import reverse
from django.utils.html import format_html

from jobs import stats
from jobs.models import Effect, EffectEvent
from jobs.ops import words
from jobs.ops.admin_common import (
    EngineAdmin,
    LastErrorColumn,
    ReadOnlyInline,
    state_filter,
    state_tag_of,
    value_filter,
)
from jobs.ops.operations import EFFECT_OPERATIONS, operation_action


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
    actions = [operation_action(op) for op in EFFECT_OPERATIONS.values()]
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
                ),
            },
        ),
    ]

    @admin.display(description="state", ordering="state")
    def state_word(self, obj):
        return state_tag_of(obj)

    @admin.display(description="provider", ordering="provider")
    def provider_word(self, obj):
        return words.provider_tag(obj.provider)

    @admin.display(description="recipient")
    def recipient_who(self, obj):
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
