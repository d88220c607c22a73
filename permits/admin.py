"""Admin for reviewers and operators.

Operators (model-wide permissions, e.g. the ``operators`` group) see every
request. Reviewers see only the requests they hold ``review_permitrequest`` on,
read-only; assignments are managed with guardian's object-permission screen.
Applicant contacts appear (and can be edited) only for holders of
``permits.view_applicant_contact``, and each page that shows them is recorded.
Nothing per request is kept on the shared ModelAdmin instances.
"""

from __future__ import annotations

from django.contrib import admin
from django.http import Http404
from django.urls import reverse
from django.utils.html import format_html
from guardian.admin import GuardedModelAdmin
from guardian.shortcuts import get_objects_for_user

from jobs.admin import register_subject
from jobs.models import Job
from permits import reports, selectors
from permits.models import (
    CONTACT_PERM,
    PRIVATE_FIELDS,
    REVIEW_PERM,
    ApplicantContactView,
    PermitRequest,
    ReviewDecision,
    Tenant,
)


def _is_operator(request, model=PermitRequest) -> bool:
    opts = model._meta
    return request.user.has_perm(f"{opts.app_label}.view_{opts.model_name}")


def _is_reviewer(request) -> bool:
    return request.user.is_active and request.user.groups.filter(name="reviewers").exists()


def sees_contacts(request) -> bool:
    """Whether the admin shows this user the applicant contacts (their own permission)."""
    return request.user.is_active and request.user.has_perm(CONTACT_PERM)


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
        return obj is None or _is_operator(request) or request.user.has_perm(REVIEW_PERM, obj)


@admin.register(PermitRequest)
class PermitRequestAdmin(GuardedModelAdmin):
    list_display = ("reference", "tenant", "work_type", "status", "output_revision", "report_state")
    list_filter = ("tenant", "status", "work_type")
    search_fields = ("reference", "parcel", "site_address")
    readonly_fields = ("current_report", "output_revision")
    inlines = [DecisionInline]
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
        return get_objects_for_user(request.user, REVIEW_PERM, klass=qs, accept_global_perms=False)

    def get_changelist_instance(self, request):
        changelist = super().get_changelist_instance(request)
        # One query for every row's current report instead of one per row, kept on this
        # request's row objects (this ModelAdmin instance is shared by every request).
        reports = selectors.report_jobs_by_permit(changelist.result_list)
        for permit in changelist.result_list:
            permit._report_job = reports.get(permit.pk)
        return changelist

    def has_module_permission(self, request):
        return _is_operator(request) or _is_reviewer(request)

    def has_view_permission(self, request, obj=None):
        if _is_operator(request):
            return True
        if obj is None:
            return _is_reviewer(request)
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
        if not getattr(obj, "_viewer_sees_jobs", False):
            return text
        return format_html(
            '<a href="{}">{}</a>', reverse("admin:jobs_job_change", args=[job.pk]), text
        )

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        if obj is not None and sees_contacts(request):  # this page shows the contacts
            ApplicantContactView.objects.create(viewer=request.user, request=obj)
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_object(self, request, object_id, from_field=None):
        obj = super().get_object(request, object_id, from_field)
        if obj is None:
            # 404, not the admin's "does not exist" redirect, for what a user may not see
            # (change, history and delete alike).
            raise Http404("No such permit request")
        # Readonly-field callables get the object, not the request.
        obj._viewer_sees_jobs = _is_operator(request, Job)
        return obj


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("key", "name")


@admin.register(ApplicantContactView)
class ApplicantContactViewAdmin(admin.ModelAdmin):
    """Who saw which request's applicant contacts in the admin, and when (read-only)."""

    list_display = ("viewed_at", "viewer", "request")
    list_filter = ("viewed_at",)
    search_fields = ("viewer__username", "request__reference")
    readonly_fields = ("viewed_at", "viewer", "request")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(ReviewDecision)
class ReviewDecisionAdmin(admin.ModelAdmin):
    list_display = ("request", "reviewer", "decision", "revision", "decided_at")
    list_filter = ("decision",)
    readonly_fields = ("request", "reviewer", "decision", "revision", "decided_at", "comment")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


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
