"""The applicant's decision letter: a chain of two jobs after a reviewer's decision.

- ``permits.decision`` (subject: the ``ReviewDecision``, revision 1) is asked for in the
  transaction that records the decision (``services.decide``). It waits until the decided
  revision's report is stored and intact (the letter cites it), records the step
  ``check`` (references only) and returns its next link, ``jobs.then(LETTER)``.
- ``permits.decision-letter`` (the engine's follow-up: subject the decision job, params
  ``{"decision": id}``) renders the letter to the applicant as a PDF on the ``heavy``
  queue (``QUEUE``: renders that may take long, served by their own worker so reports
  and notices never wait behind them), stores it and tells the deciding reviewer in the
  app that the letter is ready.

The follow-up is written by the publish that makes the decision job succeeded, so the
letter exists exactly once and only after its check (docs/app/chains.md). A decision
changed before its letter is written gets no letter (the change has its own chain).
"""

from __future__ import annotations

import hashlib
import io
from xml.sax.saxutils import escape

from reportlab.lib.pagesizes import A4
from reportlab.lib.styles import getSampleStyleSheet
from reportlab.lib.units import mm
from reportlab.platypus import Paragraph, SimpleDocTemplate, Spacer

import jobs
from jobs.artifacts import is_intact
from jobs.exceptions import NotAuthorized, PayloadInvalid, TemporaryFailure
from jobs.models import Artifact, Effect, Job
from jobs.ops.causes import Cause, register_cause
from permits import reports
from permits.models import ReviewDecision

DECISION = "permits.decision"
LETTER = "permits.decision-letter"
DECISION_SUBJECT = "permits.reviewdecision"
NOTICE = "letter-notice"
#: The second queue: heavy renders, served by ``jobs_worker --queue heavy``.
QUEUE = "heavy"
# The check waits for the report: a report still running is tried again in a few
# seconds; this budget outlasts a report's own retries on a slow demo machine.
REPORT_WAIT_SECONDS = 5
DECISION_MAX_ATTEMPTS = 12


class ReportNotReady(TemporaryFailure):
    """Raised when the decided revision's report is not stored and intact (yet)."""

    code = "report_pending"


CAUSES = {
    (DECISION, "report_pending"): Cause(
        "The decision's letter waits for the report of the decided revision, which is not "
        "stored yet (or its file is not intact).",
        reviewer="The decision letter waits for the report of this revision.",
        fix="Look at the request's report job; once it succeeded, requeue this job.",
    ),
    (LETTER, "decision_changed"): Cause(
        "The reviewer changed the decision before its letter was written: the changed "
        "decision has its own letter, this one is not sent.",
        requeue_helps=False,
        fix="Nothing to do: the letter of the decision in force is the one that counts.",
    ),
}


def request_decision_job(decision: ReviewDecision, tenant_key: str) -> Job:
    """Ask for the chain's first link of ``decision`` (idempotent; in the caller's
    transaction, so it exists exactly when the decision does)."""
    handle = jobs.request(DECISION, (DECISION_SUBJECT, decision.pk), tenant=tenant_key)
    return handle.job


def _decision(ctx: jobs.JobContext, pk: object) -> ReviewDecision:
    """The decision, read only while this worker still holds the job."""
    if not isinstance(pk, int):
        raise PayloadInvalid("the job must name a decision id")
    found = ctx.read(
        ReviewDecision.objects.select_related("request__tenant", "reviewer").filter(pk=pk)
    )
    if not found:
        raise PayloadInvalid("the decision no longer exists")
    return found[0]


def _in_force(decision: ReviewDecision) -> bool:
    return not ReviewDecision.objects.filter(supersedes=decision).exists()


def _policy(decision: ReviewDecision, job: Job) -> None:
    """Raise NotAuthorized when the letter may not be made now (withdrawn, moved office)."""
    permit = decision.request
    if permit.is_withdrawn:
        raise NotAuthorized("the request was withdrawn")
    if permit.tenant.key != job.tenant_key:
        raise NotAuthorized("the request now belongs to another office")


def report_of(decision: ReviewDecision) -> tuple[Job | None, Artifact | None]:
    """The report job of the decided revision and its artifact (None while not stored)."""
    job = Job.objects.filter(
        kind=reports.KIND,
        subject_type=reports.SUBJECT_TYPE,
        subject_id=str(decision.request_id),
        output_revision=decision.revision,
    ).first()
    if job is None or job.state != Job.State.SUCCEEDED:
        return job, None
    return job, Artifact.objects.filter(job=job, state=Artifact.State.STORED).first()


def check_decision(ctx: jobs.JobContext) -> list:
    """The chain's first link: the decision is in force and its report stored; then the
    letter (the next link, on the heavy queue)."""
    try:
        pk = int(ctx.job.subject_id)
    except ValueError:
        raise PayloadInvalid("subject_id must be a decision id") from None
    decision = _decision(ctx, pk)
    _policy(decision, ctx.job)
    if not _in_force(decision):
        return []  # changed meanwhile: the change's own chain writes the letter
    ctx.progress(0, 1, "waiting for the report")
    report, artifact = report_of(decision)
    if artifact is None or not is_intact(artifact):
        raise ReportNotReady(
            "the decided revision's report is not stored yet", retry_after=REPORT_WAIT_SECONDS
        )
    ctx.step(
        "check",
        lambda: {"decision": decision.pk, "report_job": report.pk, "sha256": artifact.sha256},
    )
    ctx.progress(1, 1, "report found")
    return [jobs.then(LETTER, params={"decision": decision.pk}, name="letter")]


def render_letter(decision: ReviewDecision, report: Artifact | None) -> bytes:
    """The letter to the applicant (deterministic: the same decision, the same bytes)."""
    permit = decision.request
    buf = io.BytesIO()
    doc = SimpleDocTemplate(
        buf,
        pagesize=A4,
        invariant=1,
        title=f"Decision on {permit.reference} revision {decision.revision}",
        author=permit.tenant.name,
        leftMargin=22 * mm,
        rightMargin=22 * mm,
        topMargin=20 * mm,
        bottomMargin=20 * mm,
    )
    styles = getSampleStyleSheet()
    body = styles["BodyText"]
    outcome = {
        ReviewDecision.Decision.APPROVE: "has been approved",
        ReviewDecision.Decision.REQUEST_CHANGES: "needs changes before it can be approved",
        ReviewDecision.Decision.REJECT: "has been rejected",
    }[decision.decision]
    story = [
        Paragraph(escape(permit.tenant.name), styles["Normal"]),
        Spacer(1, 6 * mm),
        Paragraph(escape(permit.applicant_name), body),
        Paragraph(escape(permit.site_address), body),
        Spacer(1, 8 * mm),
        Paragraph(f"Decision on permit request {escape(permit.reference)}", styles["Title"]),
        Paragraph(
            f"Your request for {escape(permit.get_work_type_display().lower())} work at "
            f"{escape(permit.site_address)} (revision {decision.revision}) {outcome}.",
            body,
        ),
    ]
    if decision.comment:
        story += [Paragraph("The reviewer's reasons", styles["Heading2"])]
        story += [Paragraph(escape(decision.comment), body)]
    if report is not None:
        story += [
            Spacer(1, 6 * mm),
            Paragraph(
                f"This letter follows the review report {escape(report.key)} "
                f"(SHA-256 {report.sha256[:16]}…).",
                styles["Italic"],
            ),
        ]
    story += [
        Spacer(1, 6 * mm),
        Paragraph(f"Decided {decision.decided_at:%Y-%m-%d}.", body),
    ]
    doc.build(story)
    return buf.getvalue()


def write_letter(ctx: jobs.JobContext) -> list[jobs.EffectSpec]:
    """The chain's second link: render and store the letter, tell the reviewer."""
    decision = _decision(ctx, ctx.params.get("decision"))
    _policy(decision, ctx.job)
    if not _in_force(decision):
        raise NotAuthorized("the decision was changed", code="decision_changed")
    ctx.progress(0, 2, "render")
    _, report = report_of(decision)
    pdf = render_letter(decision, report)
    ctx.step("render", lambda: {"sha256": hashlib.sha256(pdf).hexdigest(), "bytes": len(pdf)})
    ctx.progress(1, 2, "store")
    ctx.heartbeat()
    art = ctx.store_artifact(pdf, content_type="application/pdf", extension="pdf")
    ctx.step("store", lambda: {"file": art.storage_name, "sha256": art.sha256})
    ctx.progress(2, 2, "stored")
    permit = decision.request
    title = f"Decision letter ready: {permit.reference} revision {decision.revision}"
    link = f"/requests/{permit.pk}/"
    return [
        jobs.EffectSpec(NOTICE, "inapp", str(decision.reviewer_id), {"title": title, "link": link})
    ]


def letter_words(decision: ReviewDecision) -> str:
    """Where the applicant's letter of ``decision`` stands, in the reviewer's words (the
    reviewer's page; two reads: the chain's first job, then the letter it requested)."""
    head = Job.objects.filter(
        kind=DECISION, subject_type=DECISION_SUBJECT, subject_id=str(decision.pk)
    ).first()
    if head is None:
        return "not asked for (decided before letters were written)"
    letter = Job.objects.filter(parent=head).first()
    if letter is None:
        if head.state in Job.TERMINAL and head.state != Job.State.SUCCEEDED:
            return "could not be prepared; the office's operators have been told"
        if head.last_error_code == ReportNotReady.code:
            return "waits for the report of this revision"
        return "being prepared"
    if letter.state == Job.State.SUCCEEDED:
        return "ready for the office to send"
    if letter.state in Job.TERMINAL:
        return "not written: the office's operators have been told"
    return "being prepared"


def authorize_release(effect: Effect) -> str | None:
    """The reviewer still reviews the request when the letter's notice goes out."""
    decision_pk = effect.job.params.get("decision")
    permit_pk = (
        ReviewDecision.objects.filter(pk=decision_pk).values_list("request_id", flat=True).first()
    )
    if permit_pk is None:
        return "the decision no longer exists"
    return reports.review_release(permit_pk, effect.recipient)


def register() -> None:
    jobs.register_kind(DECISION, check_decision, max_attempts=DECISION_MAX_ATTEMPTS)
    # The letter quotes the applicant's name and address: its failures keep the class and
    # frames only (no message could carry them into an error field).
    jobs.register_kind(
        LETTER, write_letter, authorize_release=authorize_release, redact_errors=True, queue=QUEUE
    )
    for (kind, code), cause in CAUSES.items():
        register_cause(code, cause, kind=kind)
