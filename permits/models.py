"""The permit domain: offices, requests under review, and reviewers' decisions.

Applicant contact and identity fields are private: they appear only on pages
and in reports for assigned reviewers, never in logs, error fields or notices.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

REVIEW_PERM = "permits.review_permitrequest"
# Reading applicant contacts in the admin is its own duty, apart from running jobs.
CONTACT_PERM = "permits.view_applicant_contact"
PRIVATE_FIELDS = ("applicant_name", "applicant_phone", "applicant_email", "applicant_id_number")


class Tenant(models.Model):
    """A permit office (jurisdiction); jobs carry its key for per-tenant bounds."""

    key = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class PermitRequest(models.Model):
    class Status(models.TextChoices):
        SUBMITTED = "submitted", "Submitted"
        IN_REVIEW = "in_review", "In review"
        CHANGES_REQUESTED = "changes_requested", "Changes requested"
        APPROVED = "approved", "Approved"
        REJECTED = "rejected", "Rejected"
        WITHDRAWN = "withdrawn", "Withdrawn"

    class WorkType(models.TextChoices):
        NEW_BUILDING = "new_building", "New building"
        ADDITION = "addition", "Addition"
        ALTERATION = "alteration", "Alteration"
        DEMOLITION = "demolition", "Demolition"
        ELECTRICAL = "electrical", "Electrical"
        PLUMBING = "plumbing", "Plumbing"
        MECHANICAL = "mechanical", "Mechanical"
        DECK_FENCE = "deck_fence", "Deck or fence"

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="requests")
    reference = models.CharField(max_length=32, unique=True)
    site_address = models.CharField(max_length=200)
    parcel = models.CharField(max_length=40)
    work_type = models.CharField(max_length=20, choices=WorkType.choices)
    description = models.TextField()
    valuation = models.DecimalField(max_digits=12, decimal_places=2)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.SUBMITTED)
    output_revision = models.PositiveIntegerField(
        default=1, help_text="the revision the current report is built for"
    )

    applicant_name = models.CharField(max_length=200)
    applicant_phone = models.CharField(max_length=40)
    applicant_email = models.EmailField()
    applicant_id_number = models.CharField(max_length=40)

    submitted_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-submitted_at", "-id"]
        permissions = [
            ("review_permitrequest", "Can review this permit request"),
            ("view_applicant_contact", "Can see applicant contacts in the admin"),
        ]

    def __str__(self) -> str:
        return self.reference

    @property
    def is_withdrawn(self) -> bool:
        return self.status == self.Status.WITHDRAWN


class ReviewDecision(models.Model):
    class Decision(models.TextChoices):
        APPROVE = "approve", "Approve"
        REQUEST_CHANGES = "request_changes", "Request changes"
        REJECT = "reject", "Reject"

    request = models.ForeignKey(PermitRequest, on_delete=models.CASCADE, related_name="decisions")
    reviewer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT)
    decision = models.CharField(max_length=20, choices=Decision.choices)
    comment = models.TextField(blank=True)
    revision = models.PositiveIntegerField()
    decided_at = models.DateTimeField(default=timezone.now)
    # A reviewer's decisions on one revision form a chain: the first has no
    # predecessor, each change names the one it replaces (kept, never edited).
    supersedes = models.OneToOneField(
        "self",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="superseded_by",
        help_text="the earlier decision this one changes",
    )

    class Meta:
        ordering = ["-decided_at", "-id"]
        constraints = [
            # One first decision per reviewer and revision: a double submit cannot add a
            # second; a change must name the decision it replaces (one change each).
            models.UniqueConstraint(
                fields=["request", "reviewer", "revision"],
                condition=Q(supersedes__isnull=True),
                name="permits_decision_one_per_reviewer_revision",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.get_decision_display()} on {self.request} r{self.revision}"

    @property
    def is_change(self) -> bool:
        return self.supersedes_id is not None


class ApplicantContactView(models.Model):
    """One admin page view that showed a request's applicant contacts (the audit trail)."""

    viewer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT)
    request = models.ForeignKey(PermitRequest, on_delete=models.CASCADE, related_name="+")
    viewed_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-viewed_at", "-id"]

    def __str__(self) -> str:
        return f"{self.viewer} viewed the applicant contacts of {self.request}"
