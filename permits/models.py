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
# Granting and revoking review is a third duty (office admins), audited, never to oneself.
ASSIGN_PERM = "permits.assign_reviewer"
PRIVATE_FIELDS = ("applicant_name", "applicant_phone", "applicant_email", "applicant_id_number")


class Tenant(models.Model):
    """A permit office (jurisdiction); jobs carry its key for per-tenant bounds.

    ``members`` are the people whose duties are bound to this office: its office admins
    see and assign on its requests only, and only its reviewers may be assigned to them
    (``permits.offices``). A superuser belongs to none and is bound by none.
    """

    key = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    members = models.ManyToManyField(
        settings.AUTH_USER_MODEL,
        blank=True,
        related_name="offices",
        help_text="office admins and reviewers of this office",
    )

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
            ("assign_reviewer", "Can assign and revoke reviewers of permit requests"),
        ]

    def __str__(self) -> str:
        return self.reference

    @property
    def is_withdrawn(self) -> bool:
        return self.status == self.Status.WITHDRAWN

    @property
    def work_type_words(self) -> str:
        """The work type as people read it; a stored value outside the choices says so
        instead of showing the raw value as if it were one."""
        if self.work_type in self.WorkType.values:
            return self.get_work_type_display()
        return f"{self.work_type} (not a valid work type: the office has to correct it)"


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


class ReviewerAssignment(models.Model):
    """One grant or revocation of an object permission on a request (the audit trail).

    Written in the transaction that changes guardian's row, whatever screen or code
    path changed it (``permits.signals``); never edited.
    """

    class Action(models.TextChoices):
        GRANTED = "granted", "Granted"
        REVOKED = "revoked", "Revoked"

    request = models.ForeignKey(
        PermitRequest, on_delete=models.CASCADE, related_name="assignment_records"
    )
    action = models.CharField(max_length=10, choices=Action.choices)
    permission = models.CharField(max_length=100, help_text="the permission's codename")
    reviewer = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="review_assignments",
        help_text="whom (a user)",
    )
    group = models.ForeignKey(
        "auth.Group",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        help_text="whom (a group)",
    )
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        help_text="who; empty for the system (seed, shell, migrations)",
    )
    via = models.CharField(max_length=40, blank=True, help_text="the screen or command")
    at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        whom = self.reviewer or self.group
        return f"{self.permission} {self.action} for {whom} on {self.request}"


class ReportRebuild(models.Model):
    """One rebuild a user started (a new output revision): what per-user limits count."""

    request = models.ForeignKey(PermitRequest, on_delete=models.CASCADE, related_name="+")
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    revision = models.PositiveIntegerField()
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["requested_by", "at"], name="permits_rebuild_user_at")]

    def __str__(self) -> str:
        return f"{self.requested_by} rebuilt {self.request} as revision {self.revision}"
