"""The flow rules in the admin: edit, pause and resume, each change audited.

Every write goes through ``jobs.flow`` (``set_rule``, ``pause``, ``resume``,
``delete_rule``), the same functions ``manage.py jobs_limits`` calls, so a change
from the admin or the console writes its ``FlowRuleChange`` row (who, from what, to
what) in the same transaction, and an admin ``LogEntry`` as well. The circuit and
rate state are the engine's: shown, never edited by hand. Registered when Django's
admin autodiscovery imports ``jobs.admin``.
"""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.views.decorators.http import require_POST

from jobs import fairness, flow
from jobs.models import FlowRule, FlowRuleChange
from jobs.ops import flowview


class FlowRuleForm(forms.ModelForm):
    """The same checks as ``jobs_limits`` (``jobs.flow``): the scope whole (not stripped:
    "kind:x\n" is refused, not saved as a twin), each value within its bound."""

    # No max_length here: ``flow.check_scope`` knows the column's limit and says it in
    # the same words as the console and ``jobs_limits`` (the browser still stops at it).
    scope = forms.CharField(
        strip=False,
        help_text=f"{flow.SCOPE_FORMS}; at most {flow.scope_max_length()} characters",
        widget=forms.TextInput(attrs={"maxlength": flow.scope_max_length(), "size": 60}),
    )
    concurrency = forms.IntegerField(
        required=False,
        help_text=f"most running at once, 1 to {flow.CONCURRENCY_MAX:,} "
        "(empty: the settings' default)",
    )
    rate = forms.IntegerField(
        required=False,
        help_text=f"most starts per period, 1 to {flow.RATE_MAX:,} (empty: no rate limit)",
    )
    weight = forms.IntegerField(
        required=False,
        help_text="tenant:<key> or tenant:* (the default): its share of the claims, 1 to "
        f"{fairness.WEIGHT_MAX:,} (empty: the default weight)",
    )
    period_seconds = forms.FloatField(
        initial=1.0,
        help_text=f"the rate's period in seconds, more than 0 and at most "
        f"{flow.PERIOD_MAX_SECONDS:g} (one day)",
    )

    class Meta:
        model = FlowRule
        fields = ("scope", "concurrency", "rate", "period_seconds", "paused", "weight")

    def _checked(self, name: str, check):
        try:
            return check(self.cleaned_data[name])
        except flow.FlowError as exc:
            raise forms.ValidationError(str(exc)) from exc

    def clean_scope(self):
        return self._checked("scope", flow.check_scope)

    def clean_concurrency(self):
        return self._checked("concurrency", flow.check_concurrency)

    def clean_rate(self):
        return self._checked("rate", flow.check_rate)

    def clean_weight(self):
        try:
            return fairness.check_weight(self.cleaned_data["weight"])
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from exc

    def clean(self):
        data = super().clean()
        scope = data.get("scope") or getattr(self.instance, "scope", "")
        if scope and (data.get("weight") is not None or scope == fairness.DEFAULT_SCOPE):
            other = any(data.get(n) for n in ("concurrency", "rate", "paused"))
            try:
                fairness.check_weight_scope(
                    scope, weighted=data.get("weight") is not None, other=other
                )
            except ValueError as exc:
                raise forms.ValidationError(str(exc)) from exc
        return data

    def clean_period_seconds(self):
        return self._checked("period_seconds", flow.check_period)


def _actor(request: HttpRequest) -> str:
    return f"operator:{request.user.get_username()}"


@admin.register(FlowRule)
class FlowRuleAdmin(admin.ModelAdmin):
    form = FlowRuleForm
    list_display = ("scope", "rule", "paused", "circuit_state", "updated_at", "updated_by")
    list_filter = ("paused", "circuit_state")
    search_fields = ("scope",)
    actions = ("pause_selected", "resume_selected")
    readonly_fields = (
        "next_free_at",
        "circuit_state",
        "circuit_failures",
        "circuit_opened_at",
        "circuit_probe_at",
        "circuit_probes",
        "updated_at",
        "updated_by",
        "history",
    )

    def get_readonly_fields(self, request, obj=None):
        fields = super().get_readonly_fields(request, obj)
        return ("scope", *fields) if obj is not None else fields

    @admin.display(description="rule")
    def rule(self, obj: FlowRule) -> str:
        return obj.describe()

    @admin.display(description="changes (latest first)")
    def history(self, obj: FlowRule):
        rows = FlowRuleChange.objects.filter(scope=obj.scope)[:20]
        if not rows:
            return "—"
        return format_html(
            "<ul>{}</ul>",
            format_html_join(
                "",
                "<li>{} · {} by {}: {} → {}</li>",
                (
                    (c.at.strftime("%Y-%m-%d %H:%M:%S"), c.action, c.actor, c.before, c.after)
                    for c in rows
                ),
            ),
        )

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        scope = data.get("scope") or obj.scope
        if scope == fairness.DEFAULT_SCOPE:  # only a weight: the rest are the settings'
            saved = flow.set_rule(scope, actor=_actor(request), weight=data.get("weight"))
            obj.pk = saved.pk
            obj.refresh_from_db()
            return
        saved = flow.set_rule(
            scope,
            actor=_actor(request),
            weight=data.get("weight"),
            concurrency=data.get("concurrency"),
            rate=data.get("rate"),
            period_seconds=data.get("period_seconds") or 1.0,
            paused=bool(data.get("paused")),
        )
        obj.pk = saved.pk
        obj.refresh_from_db()

    def delete_model(self, request, obj):
        flow.delete_rule(obj.scope, actor=_actor(request))

    def delete_queryset(self, request, queryset):
        for rule in queryset:
            flow.delete_rule(rule.scope, actor=_actor(request))

    @admin.action(description="Pause the selected scopes", permissions=["change"])
    def pause_selected(self, request, queryset):
        for rule in queryset:
            flow.pause(rule.scope, actor=_actor(request))
            self.log_change(request, rule, "paused")
        self.message_user(request, f"Paused {queryset.count()} scope(s).", messages.SUCCESS)

    @admin.action(description="Resume the selected scopes", permissions=["change"])
    def resume_selected(self, request, queryset):
        for rule in queryset:
            flow.resume(rule.scope, actor=_actor(request))
            self.log_change(request, rule, "resumed")
        self.message_user(request, f"Resumed {queryset.count()} scope(s).", messages.SUCCESS)

    def get_urls(self):
        toggle = self.admin_site.admin_view(self.toggle_view)
        return [path("toggle/", toggle, name="jobs_flowrule_toggle"), *super().get_urls()]

    def toggle_view(self, request: HttpRequest):
        """The console's pause/resume buttons: POST ``scope`` and ``action``; a confirmation
        page first (what the scope holds now, who will be recorded), then the change."""
        return require_POST(self._toggle)(request)

    def _toggle(self, request: HttpRequest):
        scope, action = request.POST.get("scope", ""), request.POST.get("action", "")
        if not self.has_change_permission(request):
            return refused(
                request,
                f"Changing flow rules needs the permission to change flow rules "
                f"(jobs.change_flowrule); {request.user.get_username()} does not hold it. "
                "Ask someone in the operators group or a superuser.",
            )
        if action not in ("pause", "resume"):
            return refused(request, f"{action[:20]!r} is no flow-rule action: pause or resume.")
        try:
            flow.check_scope(scope)
        except flow.FlowError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return HttpResponseRedirect(reverse("admin:jobs_job_dashboard"))
        if request.POST.get("confirmed") != "yes":
            return self._confirm_toggle(request, scope, action)
        rule = (flow.pause if action == "pause" else flow.resume)(scope, actor=_actor(request))
        self.log_change(request, rule, f"{action}d from the console")
        done = "Paused" if action == "pause" else "Resumed"  # the admin capitalises the start
        self.message_user(
            request, f"{done} {scope} (the rule now: {rule.describe()}).", messages.SUCCESS
        )
        return HttpResponseRedirect(reverse("admin:jobs_job_dashboard"))

    def _confirm_toggle(self, request: HttpRequest, scope: str, action: str) -> TemplateResponse:
        view = next((v for v in flowview.scope_views() if v.scope == scope), None)
        verb = "Pause" if action == "pause" else "Resume"
        if action == "pause":
            effect = (
                "Nothing new starts under it until it is resumed; work already running "
                "finishes. Held work waits without spending an attempt."
            )
        else:
            effect = "Work held by this pause starts again within 2 seconds, within its limits."
        context = {
            **self.admin_site.each_context(request),
            "title": f"{verb} {scope}?",
            "opts": self.opts,
            "scope": scope,
            "action": action,
            "verb": verb,
            "view": view,
            "effect": effect,
            "actor": _actor(request),
            "console_url": reverse("admin:jobs_job_dashboard"),
        }
        return TemplateResponse(request, "admin/jobs/flowrule/toggle_confirm.html", context)


def refused(request: HttpRequest, reason: str, *, back: str = "") -> TemplateResponse:
    """A refused action inside the admin frame: the reason and the way back (a bare 403
    page leaves a person at 3 a.m. with nothing to do)."""
    context = {
        **admin.site.each_context(request),
        "title": "Not allowed",
        "reason": reason,
        "back_url": back or reverse("admin:jobs_job_dashboard"),
    }
    return TemplateResponse(request, "admin/jobs/refused.html", context, status=403)
