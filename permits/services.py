"""Writes of the permit domain: reports, revisions, decisions, assignments."""

from __future__ import annotations

from django.db import transaction
from django.db.models import F
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from jobs.models import Job, Notice
from jobs.services import request_job
from permits import reports
from permits.models import PermitRequest, ReviewDecision


def report_request(permit: PermitRequest, *, revision: int | None = None) -> tuple[Job, bool]:
    """The one report job for ``permit`` at ``revision`` (default: current); idempotent."""
    revision = permit.output_revision if revision is None else revision
    return request_job(
        reports.KIND,
        subject_type=reports.SUBJECT_TYPE,
        subject_id=permit.pk,
        output_revision=revision,
        tenant_key=permit.tenant.key,
    )


def request_new_revision(permit: PermitRequest, *, seen_revision: int) -> tuple[Job, bool]:
    """Bump the output revision once per revision a reviewer saw: a double submit is one bump."""
    with transaction.atomic():
        bumped = PermitRequest.objects.filter(pk=permit.pk, output_revision=seen_revision).update(
            output_revision=F("output_revision") + 1
        )
        permit.refresh_from_db(fields=["output_revision"])
        job, created = report_request(permit)
    return job, bool(bumped) and created


def decide(permit: PermitRequest, reviewer, *, decision: str, comment: str = "") -> ReviewDecision:
    """Record a reviewer's decision and move the request's status accordingly."""
    status = {
        ReviewDecision.Decision.APPROVE: PermitRequest.Status.APPROVED,
        ReviewDecision.Decision.REQUEST_CHANGES: PermitRequest.Status.CHANGES_REQUESTED,
        ReviewDecision.Decision.REJECT: PermitRequest.Status.REJECTED,
    }[decision]
    with transaction.atomic():
        made = ReviewDecision.objects.create(
            request=permit,
            reviewer=reviewer,
            decision=decision,
            comment=comment,
            revision=permit.output_revision,
        )
        PermitRequest.objects.filter(pk=permit.pk).update(status=status)
        permit.status = status
    return made


def assign_reviewer(permit: PermitRequest, user) -> None:
    assign_perm("review_permitrequest", user, permit)


def revoke_reviewer(permit: PermitRequest, user) -> None:
    remove_perm("review_permitrequest", user, permit)


def mark_notices_read(user, *, pk: int | None = None) -> int:
    """Mark the user's unread notices (or the one ``pk``) read; another user's are untouched."""
    unread = Notice.objects.filter(recipient=user, read_at__isnull=True)
    if pk is not None:
        unread = unread.filter(pk=pk)
    return unread.update(read_at=timezone.now())
