"""Admin for reviewers, operators and office admins.

Operators (model-wide permissions, e.g. the ``operators`` group) see every
request. Reviewers see only the requests they hold ``review_permitrequest`` on,
read-only. Office admins (``permits.assign_reviewer``) see the requests of their offices
(``permits.offices``) and assign and revoke reviewers of that office on each request's
"Assign reviewers" page; another office's request answers 404 on every admin URL, and a
reviewer of another office is refused (403). Every grant and revocation is recorded
(``ReviewerAssignment``) and listed on the request's page; nobody grants themselves.
Guardian's generic object-permission screens are for superusers only.

Applicant contacts appear (and can be edited) only for holders of
``permits.view_applicant_contact``, and each page that shows them is recorded.
Without it no changelist lookup, ordering, search or filter may reach them, here or
through a relation from another model: such a URL answers 400 (Django's
``DisallowedModelAdminLookup``) whatever its value, and is logged without the value.
Nothing per request is kept on the shared ModelAdmin instances.
"""

from __future__ import annotations

import logging

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.exceptions import DisallowedModelAdminLookup
from django.contrib.admin.options import IS_POPUP_VAR
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ORDER_VAR
from django.contrib.auth.models import Group
from django.core.exceptions import FieldDoesNotExist, PermissionDenied
from django.db.models import Count, Q
from django.db.models.constants import LOOKUP_SEP
from django.http import Http404, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html
from guardian.admin import GuardedModelAdmin
from guardian.shortcuts import get_objects_for_user, get_users_with_perms

from jobs.hooks import register_subject
from jobs.models import Job
from permits import offices, reports, selectors, services
from permits.models import (
    ASSIGN_PERM,
    CONTACT_PERM,
    PRIVATE_FIELDS,
    REVIEW_PERM,
    ApplicantContactView,
    PermitRequest,
    ReviewDecision,
    ReviewerAssignment,
    Tenant,
)

log = logging.getLogger("permits.admin")


def _is_operator(request, model=PermitRequest) -> bool:
    opts = model._meta
    return request.user.has_perm(f"{opts.app_label}.view_{opts.model_name}")


def _is_reviewer(request) -> bool:
    return request.user.is_active and request.user.groups.filter(name="reviewers").exists()


def sees_contacts(request) -> bool:
    """Whether the admin shows this user the applicant contacts (their own permission)."""
    return request.user.is_active and request.user.has_perm(CONTACT_PERM)


# --- no lookup, ordering, search or filter on applicant fields without the permission ----


def private_field_reached(model, lookup: str) -> str | None:
    """The applicant field that the changelist lookup ``lookup`` reaches from ``model``
    (directly or through relations, forward or reverse), or None."""
    for part in lookup.split(LOOKUP_SEP):
        try:
            field = model._meta.get_field(part)
        except FieldDoesNotExist:
            return None  # a transform or lookup name (or nothing the query accepts)
        if issubclass(model, PermitRequest) and field.name in PRIVATE_FIELDS:
            return field.name
        if not field.is_relation or field.related_model is None:
            return None
        model = field.related_model
    return None


def _log_refusal(request, model, what: str, field: str) -> None:
    """The refusal, logged with the field's name and never the value asked about."""
    log.warning(
        "admin %s refused: user=%s model=%s field=%s (needs %s)",
        what,
        request.user.pk,
        model._meta.label_lower,
        field,
        CONTACT_PERM,
    )


def _strip_search_prefix(name: str) -> str:
    return name.lstrip("=^@")


class PrivateFieldsGuard:
    """For every admin of the site's models: applicant fields are out of reach of URL
    lookups, ordering, search and list filters unless the user holds the contact
    permission (a changelist that accepted ``?applicant_phone__startswith=`` answered
    yes or no for any prefix: an oracle that spelled out the values)."""

    def lookup_allowed(self, lookup, value, request):
        if not sees_contacts(request):
            field = private_field_reached(self.model, lookup)
            if field is not None:
                _log_refusal(request, self.model, "lookup", field)
                return False  # Django answers DisallowedModelAdminLookup: 400
        return super().lookup_allowed(lookup, value, request)

    def changelist_view(self, request, extra_context=None):
        if not sees_contacts(request):
            # Django orders by column numbers only; a name here is refused all the same.
            for name in request.GET.get(ORDER_VAR, "").split("."):
                field = private_field_reached(self.model, name.lstrip("-"))
                if field is not None:
                    _log_refusal(request, self.model, "ordering", field)
                    raise DisallowedModelAdminLookup(f"Ordering by {field} not allowed")
        return super().changelist_view(request, extra_context)

    def _public(self, request, names):
        if sees_contacts(request):
            return names
        return type(names)(
            n
            for n in names
            if not isinstance(n, str)
            or private_field_reached(self.model, _strip_search_prefix(n)) is None
        )

    def get_search_fields(self, request):
        return self._public(request, super().get_search_fields(request))

    def get_list_filter(self, request):
        return self._public(request, super().get_list_filter(request))

    def get_sortable_by(self, request):
        return self._public(request, super().get_sortable_by(request))


class DecisionInline(admin.TabularInline):
    model = ReviewDecision
    extra = 0
    can_delete = False
    fields = readonly_fields = ("decided_at", "reviewer", "decision", "revision", "comment")

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_view_permission(self, request, obj=None):
        if obj is None or _is_operator(request) or can_assign(request, obj):
            return True
        return request.user.has_perm(REVIEW_PERM, obj)


class AssignmentInline(admin.TabularInline):
    """Every grant and revocation on this request: who, whom, what, when (read-only)."""

    model = ReviewerAssignment
    fk_name = "request"
    extra = 0
    can_delete = False
    verbose_name_plural = "Assignments (grants and revocations, newest first)"
    fields = readonly_fields = ("at", "action", "permission", "reviewer", "group", "actor", "via")

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_view_permission(self, request, obj=None):
        return request.user.has_perm("permits.view_reviewerassignment")


class AssignForm(forms.Form):
    reviewer = forms.ModelChoiceField(queryset=None, label="Assign a reviewer")

    def __init__(self, *args, candidates, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["reviewer"].queryset = candidates


def assigned_reviewers(permit: PermitRequest) -> list:
    """Users holding review of ``permit`` directly, by username."""
    return list(
        get_users_with_perms(
            permit, only_with_perms_in=["review_permitrequest"], with_group_users=False
        ).order_by("username")
    )


def can_assign(request, obj=None) -> bool:
    """Whether the user assigns reviewers (on ``obj``: an office admin of its office)."""
    if not (request.user.is_active and request.user.has_perm(ASSIGN_PERM)):
        return False
    return obj is None or offices.administers(request.user, obj)


class RevokeForm(forms.Form):
    """A revocation asked for; ``confirm`` once the page named what the reviewer loses."""

    user = forms.IntegerField()
    confirm = forms.BooleanField(required=False)


@admin.register(PermitRequest)
class PermitRequestAdmin(PrivateFieldsGuard, GuardedModelAdmin):
    list_display = ("reference", "tenant", "work_type", "status", "output_revision", "report_state")
    # Offices present in what the user may see (an office admin: their own offices only).
    list_filter = (("tenant", admin.RelatedOnlyFieldListFilter), "status", "work_type")
    search_fields = ("reference", "parcel", "site_address")
    readonly_fields = ("current_report", "output_revision")
    inlines = [DecisionInline, AssignmentInline]
    change_form_template = "admin/permits/permitrequest/change_form.html"
    assign_template = "admin/permits/permitrequest/reviewers.html"
    revoke_template = "admin/permits/permitrequest/revoke_confirm.html"

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        return [
            path(
                "<path:object_id>/reviewers/",
                self.admin_site.admin_view(self.reviewers_view),
                name=f"{info[0]}_{info[1]}_reviewers",
            ),
            *super().get_urls(),
        ]

    def get_readonly_fields(self, request, obj=None):
        fields = tuple(super().get_readonly_fields(request, obj))
        if obj is not None and not offices.is_global(request.user):
            # The office binds who may see and be assigned to a request: moving it is a
            # superuser's act, done with its grants (``services.move_request``).
            fields = ("tenant", *fields)
        return fields

    def save_model(self, request, obj, form, change):
        moved_to = None
        if change and "tenant" in form.changed_data:
            if not offices.is_global(request.user):
                raise PermissionDenied  # the field is read-only for them; a forged POST
            moved_to = obj.tenant
            obj.tenant_id = form.initial.get("tenant") or obj.tenant_id
        super().save_model(request, obj, form, change)
        if moved_to is not None:
            # Same transaction as the save (the admin's change view is atomic): the move
            # and the revocation of grants held by people outside the new office.
            revoked = services.move_request(obj, moved_to, by=request.user)
            self.message_user(
                request,
                f"{obj} moved to {moved_to}; {revoked} grant(s) of people outside it revoked.",
                messages.INFO,
            )
        # A request saved into review gets its report asked for (the one rule, in services).
        services.ensure_report(obj)

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change=change, **kwargs)
        if obj is None or "work_type" not in form.base_fields:
            return form
        return _showing_stored_choice(form, obj.work_type)

    def response_change(self, request, obj):
        """Saved from a job's "Fix the subject" link (``?_job=<id>``): back to that job,
        where Retry now or Requeue is one click away."""
        job = _job_to_return_to(request)
        if job is not None and "_continue" not in request.POST:
            self.message_user(
                request, f"Saved {obj}. Back to job {job.pk}: retry it now.", messages.SUCCESS
            )
            return HttpResponseRedirect(reverse("admin:jobs_job_change", args=[job.pk]))
        return super().response_change(request, obj)

    # -- assignments: the office admins' page ------------------------------------------

    def reviewers_view(self, request, object_id):
        """Assign and revoke reviewers of one request (``permits.assign_reviewer``)."""
        if request.method not in ("GET", "POST"):
            return HttpResponseNotAllowed(["GET", "POST"])
        if not can_assign(request):
            raise PermissionDenied
        obj = self.get_object(request, unquote(object_id))
        if not can_assign(request, obj):
            # Another office's request (seen, say, as its reviewer): as if it did not exist.
            raise Http404("No such permit request")
        assigned = assigned_reviewers(obj)
        candidates = offices.assignable_reviewers(obj, request.user).exclude(
            pk__in=[u.pk for u in assigned]
        )
        form = AssignForm(candidates=candidates)
        if request.method == "POST":
            action = request.POST.get("action")
            if action == "assign":
                chosen = request.POST.get("reviewer", "")
                if chosen == str(request.user.pk):
                    raise services.SelfGrantRefused
                outside = chosen.isdigit() and not offices.belongs(int(chosen), obj.tenant_id)
                if outside and not offices.is_global(request.user):
                    raise offices.OutsideOffice  # a reviewer of another office: 403
                form = AssignForm(request.POST, candidates=candidates)
                if form.is_valid():
                    user = form.cleaned_data["reviewer"]
                    services.assign_reviewer(obj, user, by=request.user, via="assign page")
                    self.message_user(request, f"{user} now reviews {obj}.", messages.SUCCESS)
                    return HttpResponseRedirect(request.path)
            elif action == "revoke":
                revoke = RevokeForm(request.POST)
                pk = revoke.cleaned_data["user"] if revoke.is_valid() else None
                user = next((u for u in assigned if u.pk == pk), None)
                if user is None:
                    self.message_user(
                        request, "That reviewer is not assigned (any more).", messages.WARNING
                    )
                elif not revoke.cleaned_data["confirm"]:
                    return self._confirm_revoke(request, obj, user)
                else:
                    services.revoke_reviewer(obj, user, by=request.user, via="assign page")
                    self.message_user(request, f"{user} no longer reviews {obj}.", messages.SUCCESS)
                return HttpResponseRedirect(request.path)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Assign reviewers: {obj}",
            "opts": self.opts,
            "original": obj,
            "assigned": assigned,
            "form": form,
            "records": obj.assignment_records.select_related("reviewer", "group", "actor")[:50],
            "is_popup": IS_POPUP_VAR in request.GET,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.assign_template, context)

    def _confirm_revoke(self, request, obj, user):
        """Name the reviewer and what they lose before the revocation happens."""
        context = {
            **self.admin_site.each_context(request),
            "title": f"Revoke {user.get_username()} from {obj}?",
            "opts": self.opts,
            "original": obj,
            "reviewer": user,
            "is_popup": IS_POPUP_VAR in request.GET,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.revoke_template, context)

    # -- guardian's generic screens: superusers only, never for themselves ---------------

    def _superusers_only(self, request) -> None:
        if not (request.user.is_active and request.user.is_superuser):
            raise PermissionDenied

    def obj_perms_manage_view(self, request, object_pk):
        self._superusers_only(request)
        return super().obj_perms_manage_view(request, object_pk)

    def obj_perms_manage_user_view(self, request, object_pk, user_id):
        self._superusers_only(request)
        if str(user_id) == str(request.user.pk):
            raise services.SelfGrantRefused
        with services.acting(request.user, "object permissions screen"):
            return super().obj_perms_manage_user_view(request, object_pk, user_id)

    def obj_perms_manage_group_view(self, request, object_pk, group_id):
        self._superusers_only(request)
        if Group.objects.filter(pk=group_id, user=request.user).exists():
            raise services.SelfGrantRefused
        with services.acting(request.user, "object permissions screen"):
            return super().obj_perms_manage_group_view(request, object_pk, group_id)

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        context["can_assign_reviewers"] = obj is not None and can_assign(request, obj)
        if context["can_assign_reviewers"]:
            context["assigned_reviewers"] = assigned_reviewers(obj)
        context["can_manage_object_permissions"] = request.user.is_superuser
        if obj is not None and sees_contacts(request):  # this page shows the contacts
            ApplicantContactView.objects.create(viewer=request.user, request=obj)
        return super().render_change_form(request, context, add, change, form_url, obj)

    fieldsets = [
        (None, {"fields": ("tenant", "reference", "status", "output_revision", "current_report")}),
        (
            "Site and work",
            {"fields": ("site_address", "parcel", "work_type", "description", "valuation")},
        ),
        ("Applicant (confidential)", {"fields": PRIVATE_FIELDS}),
    ]

    def get_fieldsets(self, request, obj=None):
        # The form is built from these fieldsets, so without the permission the contact
        # fields are neither shown nor accepted from a POST.
        if sees_contacts(request):
            return self.fieldsets
        return [fs for fs in self.fieldsets if not set(fs[1]["fields"]) & set(PRIVATE_FIELDS)]

    def get_queryset(self, request):
        qs = super().get_queryset(request).select_related("tenant")
        if _is_operator(request):
            return qs
        reviewing = get_objects_for_user(
            request.user, REVIEW_PERM, klass=qs, accept_global_perms=False
        )
        if not can_assign(request):
            return reviewing
        # An office admin: their offices' requests (and any they review themselves).
        mine = offices.administered(request.user, qs).values("pk")
        return qs.filter(Q(pk__in=mine) | Q(pk__in=reviewing.values("pk")))

    def get_changelist_instance(self, request):
        changelist = super().get_changelist_instance(request)
        # One query for every row's current report instead of one per row, kept on this
        # request's row objects (this ModelAdmin instance is shared by every request).
        reports = selectors.report_jobs_by_permit(changelist.result_list)
        for permit in changelist.result_list:
            permit._report_job = reports.get(permit.pk)
        return changelist

    def has_module_permission(self, request):
        return _is_operator(request) or _is_reviewer(request) or can_assign(request)

    def has_view_permission(self, request, obj=None):
        if _is_operator(request):
            return True
        if obj is None:
            return _is_reviewer(request) or can_assign(request)
        if can_assign(request, obj):
            return True
        return request.user.is_active and request.user.has_perm(REVIEW_PERM, obj)

    @admin.display(description="report")
    def report_state(self, obj):
        job = getattr(obj, "_report_job", None)
        return job.get_state_display() if job else "—"

    @admin.display(description="current report")
    def current_report(self, obj):
        job = selectors.report_job(obj)
        if job is None:
            return "not requested for this revision"
        artifact = selectors.artifact_of(job)
        text = f"job {job.pk}, revision {job.output_revision}: {job.get_state_display()}"
        if artifact is not None:
            text += f" — {artifact.size} bytes, sha256 {artifact.sha256[:12]}…"
        if getattr(job, "archived", False):
            return text + " (archived: its history is no longer kept)"  # no job page to link
        if not getattr(obj, "_viewer_sees_jobs", False):
            return text
        return format_html(
            '<a href="{}">{}</a>', reverse("admin:jobs_job_change", args=[job.pk]), text
        )

    def get_object(self, request, object_id, from_field=None):
        obj = super().get_object(request, object_id, from_field)
        if obj is None:
            # 404, not the admin's "does not exist" redirect, for what a user may not see
            # (change, history and delete alike).
            raise Http404("No such permit request")
        # Readonly-field callables get the object, not the request.
        obj._viewer_sees_jobs = _is_operator(request, Job)
        return obj


def _showing_stored_choice(form_class, stored: str):
    """The form with a stored value that is no valid choice shown as itself, marked "not
    a valid choice", instead of the empty "---------" (saving still asks for a valid one)."""
    field = form_class.base_fields["work_type"]
    valid = {str(value) for value, _ in field.choices}
    if not stored or stored in valid:
        return form_class

    class Form(form_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            shown = self.fields["work_type"]
            shown.choices = [(stored, f"{stored} (not a valid choice)"), *shown.choices]
            shown.help_text = (
                f"The stored value {stored!r} is not a valid choice: choose one of the others."
            )

    return Form


def _job_to_return_to(request) -> Job | None:
    """The job named by ``?_job=`` when this user may see it, else None."""
    raw = request.GET.get("_job", "")
    if not raw.isdigit() or not request.user.has_perm("jobs.view_job"):
        return None
    return Job.objects.filter(pk=int(raw)).first()


@admin.register(Tenant)
class TenantAdmin(PrivateFieldsGuard, admin.ModelAdmin):
    """Offices; who belongs to one (its office admins and reviewers) is set by superusers
    only: membership is what binds an office admin's duty, so nobody widens their own."""

    list_display = ("key", "name", "member_count")
    filter_horizontal = ("members",)

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(n_members=Count("members"))

    @admin.display(description="members", ordering="n_members")
    def member_count(self, obj):
        return obj.n_members

    def get_readonly_fields(self, request, obj=None):
        if request.user.is_superuser:
            return ()
        return ("members",)

    def save_related(self, request, form, formsets, change):
        # Members removed here lose their grants on this office's requests in the same
        # transaction (``permits.signals.revoke_on_leaving``), recorded as this user's.
        with services.acting(request.user, "admin: office members"):
            super().save_related(request, form, formsets, change)


class AuditTrailAdmin(PrivateFieldsGuard, admin.ModelAdmin):
    """An audit trail: listed and read, never added, changed or deleted in the admin."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(ApplicantContactView)
class ApplicantContactViewAdmin(AuditTrailAdmin):
    """Who saw which request's applicant contacts in the admin, and when (read-only)."""

    list_display = ("viewed_at", "viewer", "request")
    list_filter = ("viewed_at",)
    search_fields = ("viewer__username", "request__reference")
    readonly_fields = ("viewed_at", "viewer", "request")


@admin.register(ReviewDecision)
class ReviewDecisionAdmin(PrivateFieldsGuard, admin.ModelAdmin):
    list_display = ("request", "reviewer", "decision", "revision", "decided_at")
    list_filter = ("decision",)
    readonly_fields = ("request", "reviewer", "decision", "revision", "decided_at", "comment")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        # The reviewers' record: only a superuser deletes one (logged, and Django's admin
        # log keeps who); deleting a request that holds decisions is refused likewise.
        return bool(request.user.is_active and request.user.is_superuser)


@admin.register(ReviewerAssignment)
class ReviewerAssignmentAdmin(AuditTrailAdmin):
    """Every grant and revocation of an object permission on a request (read-only)."""

    list_display = ("at", "action", "permission", "reviewer", "group", "request", "actor", "via")
    list_filter = ("action", "via")
    search_fields = ("reviewer__username", "actor__username", "request__reference")
    readonly_fields = ("at", "action", "permission", "reviewer", "group", "request", "actor", "via")

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        if _is_operator(request):
            return qs
        return qs.filter(request__in=offices.administered(request.user))  # their offices'


# The jobs admin names report jobs by their permit reference and finds them by it
# (the jobs app never imports the site; the site tells it).
def _permit_labels(ids: list[str]) -> dict[str, str]:
    pks = [i for i in ids if i.isdigit()]
    return {
        str(pk): ref
        for pk, ref in PermitRequest.objects.filter(pk__in=pks).values_list("pk", "reference")
    }


def _permit_search(term: str):
    return PermitRequest.objects.filter(reference__icontains=term).values_list("pk", flat=True)[
        :100
    ]


register_subject(reports.SUBJECT_TYPE, labels=_permit_labels, search=_permit_search)
