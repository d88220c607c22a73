"""Writes of the permit domain: reports, revisions, decisions, assignments."""

from __future__ import annotations

from django.db import transaction
from django.db.models import F
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from jobs.models import Job, Notice
from jobs.services import request_job
from permits import reports, selectors
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


class DecisionRefused(Exception):
    """Raised when a decision cannot be recorded as asked; the message says why."""


class RequestWithdrawn(DecisionRefused):
    """Raised when the applicant withdrew the request before the decision committed."""

    def __init__(self) -> None:
        super().__init__("The applicant withdrew this request: no decision is needed.")


class RevisionMoved(DecisionRefused):
    """Raised when the report moved to another revision after the reviewer opened the form."""

    def __init__(self, seen: int, current: int) -> None:
        self.current = current
        super().__init__(
            f"The report moved to revision {current} after you opened revision {seen}. "
            "Look at the new revision, then decide again."
        )


class AlreadyDecided(DecisionRefused):
    """Raised when the reviewer already decided on this revision and did not ask to change it."""

    def __init__(self, existing: ReviewDecision) -> None:
        self.existing = existing
        label = existing.get_decision_display()
        super().__init__(
            f"You already recorded “{label}” on revision {existing.revision}. "
            "To record something else, choose “Change your decision”."
        )


class DecisionChangedElsewhere(DecisionRefused):
    """Raised when the decision being changed was itself changed (e.g. in another window)."""

    def __init__(self, current: ReviewDecision | None) -> None:
        self.current = current
        now = f" It is now “{current.get_decision_display()}”." if current else ""
        super().__init__(
            f"Your decision was changed in another window while you edited it.{now} "
            "Look at it, then change it again if you need to."
        )


DECISION_STATUS = {
    ReviewDecision.Decision.APPROVE: PermitRequest.Status.APPROVED,
    ReviewDecision.Decision.REQUEST_CHANGES: PermitRequest.Status.CHANGES_REQUESTED,
    ReviewDecision.Decision.REJECT: PermitRequest.Status.REJECTED,
}


def decide(
    permit: PermitRequest,
    reviewer,
    *,
    decision: str,
    comment: str = "",
    revision: int | None = None,
    replaces: int | None = None,
) -> tuple[ReviewDecision, bool]:
    """Record a reviewer's decision on ``revision`` and move the request's status.

    One decision per reviewer and revision: asking again without ``replaces``
    returns the recorded one when it says the same (a double submit), and is
    refused otherwise. A change names the decision it replaces and is a new row;
    the old one is kept. The request row is locked first, so a withdrawal or a
    rebuild that commits meanwhile is seen here (no lost update), and one that
    comes later waits and wins. Returns (the decision in force, whether it is new).
    """
    revision = permit.output_revision if revision is None else revision
    with transaction.atomic():
        current = PermitRequest.objects.select_for_update().get(pk=permit.pk)
        if current.is_withdrawn:
            permit.status = current.status
            raise RequestWithdrawn
        if current.output_revision != revision:
            raise RevisionMoved(revision, current.output_revision)
        mine = selectors.current_decision(current, reviewer, revision)
        same = mine is not None and (mine.decision, mine.comment) == (decision, comment)
        if replaces is None and mine is not None:
            if same:
                return mine, False
            raise AlreadyDecided(mine)
        if replaces is not None and (mine is None or mine.pk != replaces):
            raise DecisionChangedElsewhere(mine)
        if same:
            return mine, False
        made = ReviewDecision.objects.create(
            request=current,
            reviewer=reviewer,
            decision=decision,
            comment=comment,
            revision=revision,
            supersedes=mine,
        )
        status = DECISION_STATUS[decision]
        PermitRequest.objects.filter(pk=permit.pk).update(status=status)
        permit.status = status
    return made, True


def withdraw(permit: PermitRequest) -> bool:
    """The applicant withdrew: the request leaves review, whatever decision is in flight."""
    done = (
        PermitRequest.objects.filter(pk=permit.pk)
        .exclude(status=PermitRequest.Status.WITHDRAWN)
        .update(status=PermitRequest.Status.WITHDRAWN)
    )
    permit.status = PermitRequest.Status.WITHDRAWN
    return done == 1


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
