"""Reads of the permit domain, always through the reader's object permissions."""

from __future__ import annotations

from django.db.models import Exists, OuterRef
from django.http import Http404
from guardian.shortcuts import get_objects_for_user

from jobs import archive
from jobs.models import Artifact, Attempt, Job, JobEvent, Notice
from permits import reports
from permits.models import REVIEW_PERM, PermitRequest, ReviewDecision


def requests_for(user):
    """Requests ``user`` may review (object permission), newest first."""
    return get_objects_for_user(
        user,
        REVIEW_PERM,
        klass=PermitRequest.objects.select_related("tenant"),
        accept_global_perms=False,
    ).order_by("-submitted_at", "-id")


DECIDED = (
    PermitRequest.Status.APPROVED,
    PermitRequest.Status.CHANGES_REQUESTED,
    PermitRequest.Status.REJECTED,
    PermitRequest.Status.WITHDRAWN,
)


def queue_view(mine, *, view: str, oldest_first: bool = False, reference: str = ""):
    """A reviewer's requests: ``todo`` (still in review) or ``decided`` (a decision is in
    force, or the applicant withdrew), by submitted date, optionally by reference."""
    found = (
        mine.filter(status__in=DECIDED) if view == "decided" else mine.exclude(status__in=DECIDED)
    )
    if reference:
        found = found.filter(reference__icontains=reference)
    order = ("submitted_at", "id") if oldest_first else ("-submitted_at", "-id")
    return found.order_by(*order)


def queue_counts(mine) -> dict[str, int]:
    """How many of the reviewer's requests are to do and decided (for the view tabs)."""
    from django.db.models import Count, Q

    return mine.aggregate(
        todo=Count("pk", filter=~Q(status__in=DECIDED)),
        decided=Count("pk", filter=Q(status__in=DECIDED)),
    )


def request_for(user, pk: int) -> PermitRequest:
    """The request, or 404 when the user may not see it (no existence leak)."""
    permit = PermitRequest.objects.select_related("tenant").filter(pk=pk).first()
    if permit is None or not user.is_active or not user.has_perm(REVIEW_PERM, permit):
        raise Http404("No such permit request")
    return permit


def report_job(permit: PermitRequest, revision: int | None = None) -> Job | None:
    """The one report job for the request's current (or given) revision; an archived one's
    read-only stand-in (``job.archived``) when its rows were archived (``jobs.archive``)."""
    revision = permit.output_revision if revision is None else revision
    job = Job.objects.filter(
        kind=reports.KIND,
        subject_type=reports.SUBJECT_TYPE,
        subject_id=str(permit.pk),
        output_revision=revision,
    ).first()
    if job is not None:
        return job
    record = archive.find(reports.KIND, reports.SUBJECT_TYPE, str(permit.pk), revision)
    return None if record is None else archive.stand_in(record)


def report_jobs_by_permit(permits) -> dict[int, Job]:
    """Current report jobs for many requests in one query."""
    wanted = {(str(p.pk), p.output_revision): p.pk for p in permits}
    jobs = Job.objects.filter(
        kind=reports.KIND, subject_type=reports.SUBJECT_TYPE, subject_id__in=[k[0] for k in wanted]
    )
    return {
        wanted[(j.subject_id, j.output_revision)]: j
        for j in jobs
        if (j.subject_id, j.output_revision) in wanted
    }


def artifact_of(job: Job | None) -> Artifact | None:
    if job is None or job.state != Job.State.SUCCEEDED:
        return None
    if getattr(job, "archived", False):  # its record names the kept file
        return archive.stand_in_artifact(job.archived_record)
    return Artifact.objects.filter(job=job).first()


def attempts_of(job: Job | None):
    if job is None:
        return Attempt.objects.none()
    return Attempt.objects.filter(job=job).order_by("started_at", "id")


def operator_events_of(job: Job | None):
    """Operators' actions on the job (requeue, retry now, cancel), oldest first."""
    if job is None:
        return JobEvent.objects.none()
    return JobEvent.objects.filter(job=job).order_by("at", "id")


def notices_for(user):
    return (
        Notice.objects.filter(recipient=user)
        .select_related("effect")
        .order_by("-created_at", "-id")
    )


# --- reads for the reviewer pages -------------------------------------------------


def is_assigned(user, permit: PermitRequest) -> bool:
    """Whether ``user`` holds the review permission on ``permit`` itself (not as superuser)."""
    from guardian.shortcuts import get_group_perms, get_user_perms

    if not user.is_active:
        return False
    codename = REVIEW_PERM.split(".", 1)[1]
    return (
        get_user_perms(user, permit).filter(codename=codename).exists()
        or get_group_perms(user, permit).filter(codename=codename).exists()
    )


def report_jobs_of(permit: PermitRequest):
    """Every report job of the request, newest revision first."""
    return Job.objects.filter(
        kind=reports.KIND, subject_type=reports.SUBJECT_TYPE, subject_id=str(permit.pk)
    ).order_by("-output_revision")


def decisions_of(permit: PermitRequest):
    """Every decision on the request, newest first; changes and replaced ones marked."""
    replaced = ReviewDecision.objects.filter(supersedes=OuterRef("pk"))
    return (
        permit.decisions.select_related("reviewer", "supersedes")
        .annotate(is_replaced=Exists(replaced))
        .order_by("-decided_at", "-id")
    )


def decisions_in_force(permit: PermitRequest, revision: int):
    """Each reviewer's decision in force on ``revision`` (the last of each chain)."""
    return (
        permit.decisions.filter(revision=revision, superseded_by__isnull=True)
        .select_related("reviewer")
        .order_by("-decided_at", "-id")
    )


def current_decision(permit: PermitRequest, reviewer, revision: int) -> ReviewDecision | None:
    """The reviewer's decision in force on ``revision``: the last of its chain of changes."""
    if not reviewer.is_authenticated:
        return None
    return (
        ReviewDecision.objects.filter(
            request=permit, reviewer=reviewer, revision=revision, superseded_by__isnull=True
        )
        .order_by("-decided_at", "-id")
        .first()
    )


def unread_notice_count(user) -> int:
    return Notice.objects.filter(recipient=user, read_at__isnull=True).count()


def notice_for(user, pk: int) -> Notice:
    """The user's own notice, or 404 (another user's notice does not exist for them)."""
    notice = Notice.objects.filter(pk=pk, recipient=user).first()
    if notice is None:
        raise Http404("No such notice")
    return notice


def effects_for_recipient(job: Job | None, user):
    """The ledger rows of ``job`` addressed to ``user`` (their notices, one per channel)."""
    from jobs.models import Effect

    if job is None or job.state != Job.State.SUCCEEDED:
        return Effect.objects.none()
    return Effect.objects.filter(job=job, recipient=str(user.pk)).order_by("provider", "id")
