"""Reviewer notices for every turn of a request, not only "Report ready".

Each notice caused by an event is a small job kind whose subject names the event, so
asking twice returns the same job (the engine's unique kind, subject and revision), and
its one in-app effect goes through the effect ledger under its own identity, rechecked
at release like every notice (``authorize_release``):

- ``permits.assigned-notice``: "New request assigned to you". Subject: the
  ``ReviewerAssignment`` row of the grant (revision 1). Asked for in the transaction
  that wrote guardian's row (``permits.signals``), whatever screen wrote it.
- ``permits.report-stopped-notice``: "Report could not be built". Subject: the report
  job; revision: the attempt that stopped it. The engine sends no signal when a job
  stops (its arrows are compare-and-swap UPDATEs, so no ``post_save`` either), so two
  places that do run at a stop ask for it: the report handler, when it raises on what may
  be its last try (a permanent class, or the budget's last attempt: the engine then
  decides), and ``post_save`` of the ``Attempt`` row the
  engine inserts when it buries a job whose budget the crashes spent. The notice job
  itself reads the report job: it notifies only when that attempt really stopped it
  (``failed``/``dead``), waits (a retry later) while the engine has not settled the
  attempt yet, and notifies nobody when the report was tried again.

On a revocation the reviewer's notices of that request stop pointing at it: they say
"No longer assigned" and link nowhere (``forget_request``), in the revocation's
transaction.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from django.urls import reverse

import jobs
from jobs.delivery.runner import JobContext
from jobs.exceptions import LeaseLost, PayloadInvalid, TemporaryFailure
from jobs.models import Attempt, Effect, Job, Notice
from jobs.registry import EffectSpec
from permits.models import PermitRequest, ReviewerAssignment

log = logging.getLogger("permits.notices")

ASSIGNED = "permits.assigned-notice"
STOPPED = "permits.report-stopped-notice"
ASSIGNED_SUBJECT = "permits.reviewerassignment"
STOPPED_SUBJECT = "jobs.job"
# How long the stop notice waits for the engine to settle the report's attempt: retries
# with the site's backoff; this budget outlasts several leases of a killed worker.
STOPPED_MAX_ATTEMPTS = 12


def request_link(permit_pk: int) -> str:
    return reverse("request_detail", args=[permit_pk])


def _permit(ctx: jobs.JobContext) -> PermitRequest:
    """The request the notice is about, read only while this worker still holds the job."""
    permit_pk = ctx.job.params.get("permit")
    if not isinstance(permit_pk, int):
        raise PayloadInvalid("params.permit must be a permit request id")
    found = ctx.read(PermitRequest.objects.filter(pk=permit_pk))
    if not found:
        raise PayloadInvalid("the permit request no longer exists")
    return found[0]


# --- "New request assigned to you" ---------------------------------------------------


def assigned_notice(ctx: jobs.JobContext) -> list[jobs.EffectSpec]:
    """One notice to the reviewer the grant named, if the grant is still the last word."""
    permit = _permit(ctx)
    reviewer = ctx.job.params.get("reviewer")
    if not isinstance(reviewer, int):
        raise PayloadInvalid("params.reviewer must be a user id")
    return [
        jobs.EffectSpec(
            "assigned-notice",
            "inapp",
            str(reviewer),
            {
                "title": f"New request assigned to you: {permit.reference}",
                "link": request_link(permit.pk),
            },
        )
    ]


def ask_assigned_notice(record: ReviewerAssignment) -> None:
    """Ask for the notice of one grant (in the grant's transaction; idempotent)."""
    jobs.request(
        ASSIGNED,
        (ASSIGNED_SUBJECT, record.pk),
        revision=1,
        params={"permit": record.request_id, "reviewer": record.reviewer_id},
        tenant=record.request.tenant.key,
    )


# --- "Report could not be built" -----------------------------------------------------

STOPPED_STATES = (Job.State.FAILED, Job.State.DEAD)
UNSETTLED = (Job.State.RUNNING,)


def stopped_notice(ctx: jobs.JobContext) -> list[jobs.EffectSpec]:
    """One notice per assigned reviewer when attempt ``revision`` stopped the report."""
    from permits import reports

    ctx.check_owner()
    report = Job.objects.filter(pk=ctx.job.subject_id, kind=reports.KIND).first()
    if report is None:
        raise PayloadInvalid("the report job no longer exists")
    attempt = ctx.job.output_revision
    if report.attempts == attempt and report.state in UNSETTLED:
        # The handler raised, and the engine has not committed what follows (or the
        # worker died before it could: the lease's expiry settles it). Look again later.
        raise TemporaryFailure("the report's attempt is not settled yet", code="unsettled")
    if report.attempts != attempt or report.state not in STOPPED_STATES:
        return []  # tried again (or still going): a later stop has its own notice
    permit = _permit(ctx)
    title = (
        f"Report could not be built: {permit.reference} revision {report.output_revision}. "
        "The office has been told; nothing to do for you."
    )
    link = request_link(permit.pk)
    return [
        jobs.EffectSpec("stopped-notice", "inapp", str(user.pk), {"title": title, "link": link})
        for user in reports.reviewers_of(permit)
    ]


def may_stop(exc: BaseException, job: Job) -> bool:
    """Whether the engine may stop the job after ``exc`` (a permanent class, or the last
    attempt of its budget), by the engine's own retry table. Asking for a notice job on
    every failure would leave one per retry; the notice job checks what really happened
    either way, so erring towards asking is safe."""
    try:
        from jobs.retry import classify
    except ImportError:  # the table moved: ask every time
        return True
    try:
        rule = classify(exc).rule
    except Exception:  # never mask the failure the engine must see
        return True
    return not rule.retry or job.attempts >= job.max_attempts


def telling_when_stopped(handler: Callable[[JobContext], list[EffectSpec]]):
    """``handler`` (the report's), asking for the stop notice when it raises on what may be
    the report's last try: the notice job tells the reviewers only if the engine then
    stopped the report."""

    @functools.wraps(handler)
    def run(ctx: JobContext) -> list[EffectSpec]:
        try:
            return handler(ctx)
        except LeaseLost:
            raise  # another worker owns the job: this attempt decides nothing
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            if may_stop(exc, ctx.job):
                ask_stopped_notice(ctx.job.pk)
            raise

    return run


def ask_stopped_notice(report_id: int) -> None:
    """Ask for the stop notice of the report job's current attempt (idempotent).

    Never raises: it runs on the way out of a failure, which must reach the engine as it
    was; a request lost here is logged with ids.
    """
    try:
        row = Job.objects.filter(pk=report_id).values("attempts", "subject_id", "tenant_key")
        report = row.first()
        if report is None or not str(report["subject_id"]).isdigit():
            return
        jobs.request(
            STOPPED,
            (STOPPED_SUBJECT, report_id),
            revision=max(1, report["attempts"]),
            params={"permit": int(report["subject_id"])},
            tenant=report["tenant_key"],
        )
    except Exception as exc:  # the report's own failure is what the engine must see
        log.warning("job=%s stop notice not requested (%s)", report_id, type(exc).__name__)


def on_attempt_recorded(sender, instance: Attempt, created: bool = False, **kwargs) -> None:
    """The engine buried a report job at a claim (its crashes spent the budget)."""
    from permits import reports

    if not created or instance.outcome != Attempt.Outcome.DEAD:
        return
    if Job.objects.filter(pk=instance.job_id, kind=reports.KIND).exists():
        ask_stopped_notice(instance.job_id)


# --- the recheck at release, for both kinds --------------------------------------------


def authorize_release(effect: Effect) -> str | None:
    """The recipient still reviews the request (the same rule as the report's notices)."""
    from permits import reports

    permit_pk = effect.job.params.get("permit")
    if not isinstance(permit_pk, int):
        return "the notice names no permit request"
    return reports.review_release(permit_pk, effect.recipient)


# --- revocation --------------------------------------------------------------------


NO_LONGER = "No longer assigned: {reference}"


def forget_request(permit_pk: int, user_id: int) -> int:
    """The reviewer's notices of a request they lost: read, no link, "No longer assigned"."""
    from django.utils import timezone

    reference = PermitRequest.objects.filter(pk=permit_pk).values_list("reference", flat=True)
    reference = reference.first()
    if reference is None:
        return 0
    mine = Notice.objects.filter(recipient_id=user_id, link=request_link(permit_pk))
    mine.filter(read_at__isnull=True).update(read_at=timezone.now())
    return mine.update(title=NO_LONGER.format(reference=reference)[:200], link="")


def register() -> None:
    from django.db.models.signals import post_save

    jobs.register_kind(ASSIGNED, assigned_notice, authorize_release=authorize_release)
    jobs.register_kind(
        STOPPED,
        stopped_notice,
        authorize_release=authorize_release,
        max_attempts=STOPPED_MAX_ATTEMPTS,
    )
    post_save.connect(on_attempt_recorded, sender=Attempt, dispatch_uid="permits.stopped")
