"""Writes of the permit domain: reports, revisions, decisions, assignments."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Count, F, Min
from django.utils import timezone
from guardian.shortcuts import assign_perm, get_user_perms, remove_perm

import jobs
from jobs.models import Job, Notice
from permits import letters, offices, reports, selectors
from permits.models import PermitRequest, ReportRebuild, ReviewDecision, Tenant

#: A reviewer's "Rebuild report" waits in front of the reports asked for by assignment and
#: review (the claim takes higher priority first, then the longest waiting).
REBUILD_PRIORITY = 10


def report_request(
    permit: PermitRequest, *, revision: int | None = None, priority: int | None = None
) -> tuple[Job, bool]:
    """The one report job for ``permit`` at ``revision`` (default: current); idempotent.

    ``priority`` (default: the kind's) orders it among due reports; asking again for an
    existing job returns it unchanged."""
    revision = permit.output_revision if revision is None else revision
    handle = jobs.request(
        reports.KIND,
        (reports.SUBJECT_TYPE, permit.pk),
        revision=revision,
        tenant=permit.tenant.key,
        priority=priority,
    )
    return handle.job, handle.created


#: A request in review needs its current revision's report (a submitted one is not
#: in review yet: nobody looks at it; it gets its report when it enters review).
REVIEWING = (PermitRequest.Status.IN_REVIEW,)


def ensure_report(permit: PermitRequest) -> tuple[Job | None, bool]:
    """Ask for the current revision's report when the request is under review (idempotent).

    Called by every write that puts a request into review or moves its output
    revision (``enter_review``, ``assign_reviewer``, ``request_new_revision``, the
    admin's save), so reviewers never press a button to get the report. A request that
    left review (decided, withdrawn) gets none; (None, False) then.
    """
    if permit.status not in REVIEWING:
        return None, False
    return report_request(permit)


def enter_review(permit: PermitRequest) -> tuple[Job | None, bool]:
    """Put the request into review and ask for its report in the same transaction."""
    with transaction.atomic():
        PermitRequest.objects.filter(pk=permit.pk).update(status=PermitRequest.Status.IN_REVIEW)
        permit.status = PermitRequest.Status.IN_REVIEW
        return ensure_report(permit)


def regenerate_cancelled(permit: PermitRequest, *, seen_revision: int) -> tuple[Job, bool]:
    """The fallback for a report an operator cancelled: a fresh revision, once per revision.

    A cancelled job stays cancelled (one job per kind, subject and revision), so the way
    forward is the next revision, like a rebuild, without counting against the user's
    rebuild limit (nobody asked twice: the first report never came).
    """
    job = selectors.report_job(permit, seen_revision)
    if job is None:
        return report_request(permit, revision=seen_revision)
    if job.state != Job.State.CANCELLED:
        return job, False
    return request_new_revision(permit, seen_revision=seen_revision)


class RebuildRefused(Exception):
    """Raised when a rebuild is not started; the message says why and what to do."""


class ReportStillBeingPrepared(RebuildRefused):
    """Raised when the current revision's report is still being prepared."""

    def __init__(self, revision: int) -> None:
        super().__init__(
            f"The report of revision {revision} is still being prepared. Wait until it is "
            "ready (or has stopped), then rebuild if you still need to."
        )


class RebuildLimitReached(RebuildRefused):
    """Raised when the user already started as many rebuilds as the window allows."""

    def __init__(self, limit: int, minutes: int, next_at: datetime) -> None:
        self.next_at = next_at
        super().__init__(
            f"You started {limit} rebuild{'s' if limit != 1 else ''} in the last {minutes} "
            f"minutes, the most allowed. You can start another after "
            f"{timezone.localtime(next_at):%H:%M} ({settings.TIME_ZONE})."
        )


PREPARING = (Job.State.QUEUED, Job.State.RUNNING, Job.State.RETRY_WAIT)
#: Causes of a stopped report that may have passed by now (a network or a service that
#: was away): a rebuild can change the outcome. Any other stop (invalid data, a policy
#: refusal, an unexpected error) comes back the same however often a reviewer rebuilds:
#: the office's operators were told and act on it.
PASSING_CAUSES = ("transport", "temporary", "provider_timeout")
DECIDED = selectors.DECIDED


class RebuildCannotHelp(RebuildRefused):
    """Raised when a rebuild cannot change the outcome (a decided request, a stop whose
    cause the reviewer cannot fix)."""


def rebuild_refusal(permit: PermitRequest, job: Job | None) -> str:
    """Why a rebuild cannot help now (the page says it instead of offering the button),
    or "" when it can."""
    if permit.status in DECIDED:
        if permit.is_withdrawn:
            return "The applicant withdrew this request: no new report is needed."
        return (
            "This request is decided: its report stays as the decision saw it. "
            "A new review starts from the office."
        )
    if job is None:
        return ""
    if job.state == Job.State.FAILED or (
        job.state == Job.State.DEAD and job.last_error_class not in PASSING_CAUSES
    ):
        return "The office has been told; nothing to do for you. A rebuild would stop the same way."
    return ""


def rebuild_limit() -> tuple[int, int]:
    """(rebuilds, per minutes) one user may start: ``REBUILD_LIMIT`` per
    ``REBUILD_LIMIT_WINDOW_MINUTES``, read at call time."""
    return (
        int(getattr(settings, "REBUILD_LIMIT", 5)),
        int(getattr(settings, "REBUILD_LIMIT_WINDOW_MINUTES", 60)),
    )


def rebuild_report(permit: PermitRequest, user, *, seen_revision: int) -> tuple[Job, bool]:
    """A reviewer's rebuild: a new revision, within the bounds of one user's work.

    Refused (``RebuildRefused``) while the current revision's report is still being
    prepared, and past the user's limit of rebuilds per window. A double submit of the
    page that saw an older revision is no rebuild and is never refused. The user's row
    is locked first, so two of their rebuilds at once are counted one after the other.
    """
    with transaction.atomic():
        list(get_user_model().objects.select_for_update().filter(pk=user.pk).values("pk"))
        current = PermitRequest.objects.select_for_update().get(pk=permit.pk)
        if current.output_revision == seen_revision:
            job = selectors.report_job(current)
            if job is not None and job.state in PREPARING:
                raise ReportStillBeingPrepared(seen_revision)
            refusal = rebuild_refusal(current, job)
            if refusal:
                raise RebuildCannotHelp(refusal)
            limit, minutes = rebuild_limit()
            recent = ReportRebuild.objects.filter(
                requested_by=user, at__gte=timezone.now() - timedelta(minutes=minutes)
            )
            counted = recent.aggregate(n=Count("pk"), first=Min("at"))
            if counted["n"] >= limit:
                raise RebuildLimitReached(
                    limit, minutes, counted["first"] + timedelta(minutes=minutes)
                )
        job, created = request_new_revision(
            current, seen_revision=seen_revision, priority=REBUILD_PRIORITY
        )
        permit.output_revision = current.output_revision
        if created:
            ReportRebuild.objects.create(
                request=current, requested_by=user, revision=current.output_revision
            )
    return job, created


def request_new_revision(
    permit: PermitRequest, *, seen_revision: int, priority: int | None = None
) -> tuple[Job, bool]:
    """Bump the output revision once per revision a reviewer saw: a double submit is one bump."""
    with transaction.atomic():
        bumped = PermitRequest.objects.filter(pk=permit.pk, output_revision=seen_revision).update(
            output_revision=F("output_revision") + 1
        )
        permit.refresh_from_db(fields=["output_revision"])
        job, created = report_request(permit, priority=priority)
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
        # The applicant's letter follows the report (``permits.letters``): the chain's
        # first job commits with the decision, so each decision has its letter once.
        letters.request_decision_job(made, current.tenant.key)
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


# --- assignments: their own duty, recorded, never to oneself ---------------------------

_acting: ContextVar[tuple[object | None, str]] = ContextVar("permits_acting", default=(None, ""))


class SelfGrantRefused(PermissionDenied):
    """Raised when someone tries to grant a permission to themselves (or to their group)."""

    def __init__(self) -> None:
        super().__init__("Nobody can grant a permission to themselves.")


@contextmanager
def acting(user, via: str) -> Iterator[None]:
    """Attribute the grants and revocations made inside to ``user`` through ``via``."""
    token = _acting.set((user, via))
    try:
        yield
    finally:
        _acting.reset(token)


def current_actor() -> tuple[object | None, str]:
    """(who, through what) changes object permissions now; (None, "") for the system."""
    return _acting.get()


def _holds_review(user, permit: PermitRequest) -> bool:
    return get_user_perms(user, permit).filter(codename="review_permitrequest").exists()


def assign_reviewer(permit: PermitRequest, user, *, by=None, via: str = "") -> bool:
    """Grant ``user`` review of ``permit``; recorded (``ReviewerAssignment``) when it is new.

    ``by`` is who grants (None: the system, e.g. the demo seed); nobody grants themselves,
    and an office admin grants only on their offices' requests to reviewers of the
    request's office (``permits.offices.OutsideOffice``). A new grant by a person asks for
    the reviewer's "New request assigned to you" notice (``permits.signals``). Returns
    whether it was a new grant.
    """
    if by is not None and by.pk == user.pk:
        raise SelfGrantRefused
    offices.check_grant(permit, user.pk, by)  # office admins: their offices' reviewers only
    with transaction.atomic(), acting(by, via or ("system" if by is None else "service")):
        before = _holds_review(user, permit)
        assign_perm("review_permitrequest", user, permit)
        ensure_report(permit)  # the reviewer finds the report ready, never a button
    return not before


def revoke_reviewer(permit: PermitRequest, user, *, by=None, via: str = "") -> bool:
    """Take review of ``permit`` from ``user``; recorded. Returns whether it was held.

    A notice the engine has not released yet is withheld at its release (the recheck of
    ``permits.reports.authorize_release``), the reviewer's pages answer 404 at once, and
    their notices of the request say "No longer assigned" and link nowhere.
    """
    with transaction.atomic(), acting(by, via or ("system" if by is None else "service")):
        before = _holds_review(user, permit)
        remove_perm("review_permitrequest", user, permit)
    return before


def mark_notices_read(user, *, pk: int | None = None) -> int:
    """Mark the user's unread notices (or the one ``pk``) read; another user's are untouched."""
    unread = Notice.objects.filter(recipient=user, read_at__isnull=True)
    if pk is not None:
        unread = unread.filter(pk=pk)
    return unread.update(read_at=timezone.now())


# --- offices that hold: a grant on a request never outlives the office it came from -----


def _grants_on(permit_ids, user_ids=None):
    """guardian's user rows on the requests ``permit_ids`` (of ``user_ids`` when given)."""
    from django.contrib.contenttypes.models import ContentType
    from guardian.models import UserObjectPermission

    rows = UserObjectPermission.objects.filter(
        content_type=ContentType.objects.get_for_model(PermitRequest),
        object_pk__in=[str(pk) for pk in permit_ids],
    )
    return rows if user_ids is None else rows.filter(user_id__in=list(user_ids))


def revoke_office_grants(tenant_ids, user_ids, *, via: str = "office members") -> int:
    """Take every object grant of ``user_ids`` on the requests of ``tenant_ids``.

    Called when people leave an office, in the transaction that removes them: what bound
    them to those requests is gone, so is what they held on them. Each deleted row is
    recorded as a revocation (``permits.signals``) under the current actor, and the
    reviewer's notices of the request turn into "No longer assigned". Returns how many.
    """
    permit_ids = list(
        PermitRequest.objects.filter(tenant_id__in=list(tenant_ids)).values_list("pk", flat=True)
    )
    if not permit_ids or not user_ids:
        return 0
    actor, current_via = current_actor()
    with transaction.atomic(), acting(actor, current_via or via):
        rows = list(_grants_on(permit_ids, user_ids))
        for row in rows:
            row.delete()  # one post_delete each: one recorded revocation each
    return len(rows)


def move_request(permit: PermitRequest, tenant, *, by, via: str = "admin: office moved") -> int:
    """Move ``permit`` to office ``tenant`` (a superuser's duty) with its grants.

    In one transaction: the request changes office, whoever held an object grant on it
    without belonging to the new office loses it (recorded as revocations by ``by``), and
    a request in review gets its next revision's report under the new office. Returns how
    many grants were revoked.
    """
    if not (by is not None and by.is_active and by.is_superuser):
        raise PermissionDenied("Only a superuser moves a request to another office.")
    with transaction.atomic(), acting(by, via):
        PermitRequest.objects.filter(pk=permit.pk).update(tenant=tenant)
        permit.tenant = tenant
        staying = Tenant.members.through.objects.filter(tenant_id=tenant.pk).values("user_id")
        rows = list(_grants_on([permit.pk]).exclude(user_id__in=staying))
        for row in rows:
            row.delete()
        if permit.status in REVIEWING:
            # The report jobs carry the old office's key, which the report's read policy
            # refuses from now on: the next revision is built under the new office.
            request_new_revision(permit, seen_revision=permit.output_revision)
    return len(rows)
