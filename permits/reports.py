"""The permit report job kind: recheck ownership and policy, render the PDF, notify reviewers.

Rendering is deterministic (ReportLab's invariant mode; the generation time is
the job's, not the clock's), so a second worker's bytes equal the first's and
verifying the stored artifact means something.
"""

from __future__ import annotations

import functools
import hashlib
import io
import time
from collections.abc import Callable
from decimal import ROUND_CEILING, ROUND_HALF_UP, Decimal
from xml.sax.saxutils import escape

from django.conf import settings
from reportlab.lib import colors
from reportlab.lib.pagesizes import A4
from reportlab.lib.styles import getSampleStyleSheet
from reportlab.lib.units import mm
from reportlab.platypus import Paragraph, SimpleDocTemplate, Spacer, Table, TableStyle

from jobs.delivery.runner import JobContext
from jobs.exceptions import JobError, NotAuthorized, PayloadInvalid
from jobs.models import Effect, Job
from jobs.ops.causes import Cause, register_cause
from jobs.registry import EffectSpec, register_kind
from permits.models import REVIEW_PERM, PermitRequest

KIND = "permits.report"
SUBJECT_TYPE = "permits.permitrequest"
NOTICE = "completion-notice"  # in the reviewer's inbox
EXTERNAL_NOTICE = "completion-webhook"  # through NOTICE_PROVIDER_URL, when configured

WT = PermitRequest.WorkType
BASE_FEES = {
    WT.NEW_BUILDING: Decimal("500.00"),
    WT.ADDITION: Decimal("300.00"),
    WT.ALTERATION: Decimal("200.00"),
    WT.DEMOLITION: Decimal("150.00"),
    WT.ELECTRICAL: Decimal("90.00"),
    WT.PLUMBING: Decimal("90.00"),
    WT.MECHANICAL: Decimal("90.00"),
    WT.DECK_FENCE: Decimal("60.00"),
}
PLAN_REVIEW_TYPES = {WT.NEW_BUILDING, WT.ADDITION, WT.ALTERATION}
INSPECTIONS = {
    WT.NEW_BUILDING: ["Footing", "Foundation", "Framing", "Insulation", "Final"],
    WT.ADDITION: ["Footing", "Framing", "Insulation", "Final"],
    WT.ALTERATION: ["Framing", "Final"],
    WT.DEMOLITION: ["Utility disconnect", "Site clearance"],
    WT.ELECTRICAL: ["Rough-in electrical", "Final electrical"],
    WT.PLUMBING: ["Underground plumbing", "Rough-in plumbing", "Final plumbing"],
    WT.MECHANICAL: ["Rough-in mechanical", "Final mechanical"],
    WT.DECK_FENCE: ["Post holes", "Final"],
}
CHECKLIST = [
    "Site plan shows setbacks and easements",
    "Scope of work matches the declared work type",
    "Valuation is consistent with the scope",
    "Parcel number matches the site address",
    "Required inspections scheduled with the applicant",
]
CENT = Decimal("0.01")


def compute_fees(permit: PermitRequest) -> list[tuple[str, Decimal]]:
    """Fee lines and total: base by work type, $5 per started $1,000, review, surcharge."""
    base = BASE_FEES[permit.work_type]
    thousands = (permit.valuation / 1000).to_integral_value(rounding=ROUND_CEILING)
    valuation_fee = (thousands * Decimal("5.00")).quantize(CENT)
    lines = [("Base fee", base), ("Valuation fee ($5.00 per $1,000)", valuation_fee)]
    permit_fee = base + valuation_fee
    if permit.work_type in PLAN_REVIEW_TYPES:
        lines.append(
            ("Plan review (65%)", (permit_fee * Decimal("0.65")).quantize(CENT, ROUND_HALF_UP))
        )
    subtotal = sum((amount for _, amount in lines), Decimal("0"))
    lines.append(
        ("Technology surcharge (4%)", (subtotal * Decimal("0.04")).quantize(CENT, ROUND_HALF_UP))
    )
    lines.append(("Total", sum((amount for _, amount in lines), Decimal("0"))))
    return lines


def render_report(permit: PermitRequest, job: Job) -> bytes:
    """The PDF for ``permit`` at ``job.output_revision``; same input, same bytes."""
    buf = io.BytesIO()
    doc = SimpleDocTemplate(
        buf,
        pagesize=A4,
        invariant=1,
        title=f"Review report {permit.reference} revision {job.output_revision}",
        author=permit.tenant.name,
        leftMargin=18 * mm,
        rightMargin=18 * mm,
        topMargin=16 * mm,
        bottomMargin=16 * mm,
    )
    styles = getSampleStyleSheet()
    h1, h2, body = styles["Title"], styles["Heading2"], styles["BodyText"]

    def table(rows, widths, *, header=False):
        t = Table(rows, colWidths=widths, hAlign="LEFT")
        style = [
            ("FONTSIZE", (0, 0), (-1, -1), 9),
            ("VALIGN", (0, 0), (-1, -1), "TOP"),
            ("LINEBELOW", (0, 0), (-1, -1), 0.25, colors.lightgrey),
        ]
        if header:
            style.append(("FONTNAME", (0, -1), (-1, -1), "Helvetica-Bold"))
        t.setStyle(TableStyle(style))
        return t

    generated = job.created_at.strftime("%Y-%m-%d %H:%M UTC")
    story = [
        Paragraph(escape(permit.tenant.name), styles["Normal"]),
        Paragraph(f"Permit review report {escape(permit.reference)}", h1),
        Paragraph(
            f"Output revision {job.output_revision} &middot; report job {job.pk} &middot; "
            f"requested {generated}",
            body,
        ),
        Spacer(1, 4 * mm),
        Paragraph("Request summary", h2),
        table(
            [
                ["Site address", Paragraph(escape(permit.site_address), body)],
                ["Parcel", permit.parcel],
                ["Work type", permit.get_work_type_display()],
                ["Valuation", f"${permit.valuation:,.2f}"],
                ["Submitted", permit.submitted_at.strftime("%Y-%m-%d")],
            ],
            [40 * mm, 130 * mm],
        ),
        Paragraph("Description of work", h2),
        Paragraph(escape(permit.description), body),
        Paragraph("Applicant (confidential)", h2),
        table(
            [
                ["Name", permit.applicant_name],
                ["Phone", permit.applicant_phone],
                ["E-mail", permit.applicant_email],
                ["ID number", permit.applicant_id_number],
            ],
            [40 * mm, 130 * mm],
        ),
        Paragraph("Required inspections", h2),
        table(
            [[str(i), name] for i, name in enumerate(INSPECTIONS[permit.work_type], 1)],
            [10 * mm, 160 * mm],
        ),
        Paragraph("Fee computation", h2),
        table(
            [[label, f"${amount:,.2f}"] for label, amount in compute_fees(permit)],
            [120 * mm, 50 * mm],
            header=True,
        ),
        Paragraph("Reviewer checklist", h2),
        table([["[  ]", item] for item in CHECKLIST], [10 * mm, 160 * mm]),
    ]
    doc.build(story)
    return buf.getvalue()


class ReportDataInvalid(JobError):
    """Raised when a stored value of the request is none the report knows (a work type
    outside the choices): the request needs correcting, its applicant data is not read."""

    # Tried again up to its budget, as an unexplained error is: the office may correct the
    # request meanwhile, and then a try succeeds (the operator's "Fix the subject").
    error_class = "unknown"
    code = "work_type_invalid"


# What the site's own failure codes mean, in the operator's and the reviewer's words
# (``jobs.ops.causes``); the code is stored, the words are looked up when shown.
CAUSES = {
    "work_type_invalid": Cause(
        "The request's work type is not one of the valid choices, so its fees and "
        "inspections cannot be worked out.",
        reviewer="The request's work type is not a valid choice; the office has to correct "
        "the request before the report can be built.",
        field="work_type",
        fix="Correct the work type on the request (Fix the subject), then requeue the job.",
    ),
    # The engine's own codes, in the reviewers' words for a report.
    "payload_invalid": Cause(
        "The job's own parameters are malformed (checked when it ran): nothing on its "
        "subject fixes them and a requeue fails the same way.",
        reviewer="This report cannot be built as it was asked for.",
        requeue_helps=False,
        fix="Leave it failed; ask for a new job with correct parameters if one is needed.",
    ),
    "not_authorized": Cause(
        "Current policy no longer allows the job to read its subject (withdrawn, moved to "
        "another office, or a revision never asked for).",
        reviewer="The request changed so that this report is no longer made.",
        requeue_helps=False,
        fix="Nothing to do for this job: it stopped as policy asks.",
    ),
}


def check_request_data(permit: PermitRequest) -> None:
    """Refuse (``ReportDataInvalid``) a request whose stored choices the report cannot use,
    before anything is rendered: the failure then says which field, not ``KeyError``."""
    if permit.work_type not in BASE_FEES:
        raise ReportDataInvalid("the request's work type is not a valid choice")


def _load_permit(ctx: JobContext) -> PermitRequest:
    try:
        permit_id = int(ctx.job.subject_id)
    except ValueError:
        raise PayloadInvalid("subject_id must be a permit request id") from None
    found = ctx.read(PermitRequest.objects.select_related("tenant").filter(pk=permit_id))
    if not found:
        raise PayloadInvalid("the permit request no longer exists")
    return found[0]


def read_policy(permit: PermitRequest, job: Job) -> str | None:
    """Why the job may not read this request now, or None when it may."""
    if permit.is_withdrawn:
        return "the request was withdrawn"
    if permit.tenant.key != job.tenant_key:
        return "the request now belongs to another office"
    if job.output_revision > permit.output_revision:
        return "the revision was never requested"
    return None


def reviewers_of(permit: PermitRequest):
    """Users assigned to review ``permit`` directly (not superusers, not via groups)."""
    from guardian.shortcuts import get_users_with_perms

    return (
        get_users_with_perms(
            permit, only_with_perms_in=["review_permitrequest"], with_group_users=False
        )
        .filter(is_active=True)
        .order_by("pk")
    )


STAGES = ("gather", "render", "store")


def _restoring(ctx: JobContext) -> bool:
    """Whether the handler runs to put a lost file back (``jobs.restore``): no attempt,
    no lease, so no step is recorded and no progress said (both are fenced by a lease)."""
    from jobs.restore import RestoreContext

    return isinstance(ctx, RestoreContext)


def _step(ctx: JobContext, name: str, output: Callable[[], dict]) -> None:
    """Record step ``name`` (references only), except in a restore."""
    if not _restoring(ctx):
        ctx.step(name, output)


def _progress(ctx: JobContext, done: int, note: str) -> None:
    if not _restoring(ctx):
        ctx.progress(done, len(STAGES), note)


def _paced(ctx: JobContext) -> None:
    """Wait ``PERMITS_REPORT_STAGE_SECONDS`` between stages, heartbeating (0: no wait).

    A stand-in for a heavy render (a demo or a browser test watching the progress move);
    the heartbeats keep the lease while it waits."""
    left = float(getattr(settings, "PERMITS_REPORT_STAGE_SECONDS", 0) or 0)
    while left > 0:
        time.sleep(min(0.25, left))
        left -= 0.25
        ctx.heartbeat()


def build_report(ctx: JobContext) -> list[EffectSpec]:
    """Fence, policy, then the durable steps gather → render → store with progress, then
    one notice per reviewer.

    Each step records what it did as references only (ids, a hash, a size: never the
    request's data) under this worker's fence, so the job page shows how far each attempt
    got. The reads and the policy check run on every attempt (release and reading follow
    current authorization); rendering is deterministic and the artifact's key is stable,
    so an attempt after a lost lease renders the same bytes and the store verifies them.
    """
    job = ctx.job
    _progress(ctx, 0, "gather")
    permit = _load_permit(ctx)  # read only while this worker still holds the job
    reason = read_policy(permit, job)
    if reason:
        raise NotAuthorized(reason)
    check_request_data(permit)
    _step(
        ctx,
        "gather",
        lambda: {"permit": permit.pk, "revision": job.output_revision, "office": permit.tenant.key},
    )
    _paced(ctx)
    _progress(ctx, 1, "render")
    ctx.heartbeat()
    pdf = render_report(permit, job)
    _step(ctx, "render", lambda: {"sha256": hashlib.sha256(pdf).hexdigest(), "bytes": len(pdf)})
    _paced(ctx)
    _progress(ctx, 2, "store")
    ctx.heartbeat()
    art = ctx.store_artifact(pdf, content_type="application/pdf", extension="pdf")
    _step(ctx, "store", lambda: {"file": art.storage_name, "sha256": art.sha256})
    _progress(ctx, 3, "stored")
    title = f"Report ready: {permit.reference} revision {job.output_revision}"
    link = f"/requests/{permit.pk}/"
    specs = []
    for user in reviewers_of(permit):
        specs.append(EffectSpec(NOTICE, "inapp", str(user.pk), {"title": title, "link": link}))
        if getattr(
            settings, "NOTICE_PROVIDER_URL", ""
        ):  # the reviewer's device, through the HTTP provider
            specs.append(EffectSpec(EXTERNAL_NOTICE, "webhook", str(user.pk)))
    return specs


def _granted(permit_pk: int | str) -> dict:
    """The review permission on one request, as guardian stores it (by name, not by id:
    permission rows are recreated when a test database is flushed)."""
    app_label, codename = REVIEW_PERM.split(".", 1)
    return {
        "permission__codename": codename,
        "permission__content_type__app_label": app_label,
        "object_pk": str(permit_pk),
    }


def is_assigned_through_group(user_id: int | str, permit_pk: int | str) -> bool:
    from guardian.models import GroupObjectPermission

    return GroupObjectPermission.objects.filter(group__user=user_id, **_granted(permit_pk)).exists()


def authorize_release(effect: Effect) -> str | None:
    """Release follows current authorization: recheck the recipient's object permission now.

    What ``user.has_perm(REVIEW_PERM, permit)`` finds for an active account (the
    account itself is the engine's own check): the request's state and a direct
    assignment in one query; a group's assignment or a superuser only when that
    misses (guardian's own check takes four queries).
    """

    def superuser() -> bool:
        try:  # the user row the engine's release check just read (no second query)
            from jobs.delivery.policy import recipient_user
        except ImportError:  # before the engine's reshape
            from jobs.delivery.policy import recipient_user
        return recipient_user(effect).is_superuser

    return review_release(effect.job.subject_id, effect.recipient, superuser=superuser)


@functools.cache
def _release_statement() -> str:
    """The request's state and the user's direct assignment to it, in one statement.

    The same question as the ORM's ``PermitRequest.filter(pk=).annotate(direct=Exists(
    UserObjectPermission...))`` with the permission named by codename (``_granted``),
    written once as text: every report's notice asks it at its release, and the ORM took
    1.1 ms a call to compile it, this 0.3 ms.
    """
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType
    from guardian.models import UserObjectPermission

    return (
        f"SELECT p.status, EXISTS (SELECT 1 FROM {UserObjectPermission._meta.db_table} g"
        f" JOIN {Permission._meta.db_table} ap ON ap.id = g.permission_id"
        f" JOIN {ContentType._meta.db_table} ct ON ct.id = ap.content_type_id"
        " WHERE g.user_id = %s AND g.object_pk = %s AND ap.codename = %s"
        f" AND ct.app_label = %s) FROM {PermitRequest._meta.db_table} p WHERE p.id = %s"
    )


def review_release(
    permit_pk: int | str, user_id: int | str, *, superuser: Callable[[], bool] | None = None
) -> str | None:
    """Why a notice about request ``permit_pk`` may not reach user ``user_id`` now, or None.

    Shared by every notice of a request (report ready, assigned, could not be built).
    ``superuser`` answers whether the recipient is one (asked only when nothing else
    allows the release).
    """
    from django.contrib.auth import get_user_model
    from django.db import connections, router

    if superuser is None:

        def superuser() -> bool:
            return get_user_model().objects.filter(pk=user_id, is_superuser=True).exists()

    app_label, codename = REVIEW_PERM.split(".", 1)
    alias = router.db_for_read(PermitRequest)
    with connections[alias].cursor() as cursor:
        params = [int(user_id), str(permit_pk), codename, app_label, int(permit_pk)]
        cursor.execute(_release_statement(), params)
        row = cursor.fetchone()
    if row is None:
        return "the permit request no longer exists"
    status, assigned = row
    if status == PermitRequest.Status.WITHDRAWN:
        return "the request was withdrawn"
    if assigned or is_assigned_through_group(user_id, permit_pk):
        return None
    if superuser():
        return None
    return "the recipient is no longer assigned to this request"


# The report in the reviewers' words: the console and the reviewer pages say these for
# its jobs (the engine's own words are neutral: jobs.ops.words).
LABELS = {
    "job": "report",
    "result": "report PDF",
    "effect": "notice",
    "queued": "Requested",
    "running": "Being prepared",
    "succeeded": "Ready",
    "failed": "Could not be built",
}


def report_sequence(params: dict, subject: tuple[str, str]) -> str:
    """The report's sequence key: its permit request (docs/app/sequences.md)."""
    return f"permit:{subject[1]}"


def register(handler: Callable[[JobContext], list[EffectSpec]] = build_report) -> None:
    """Register the report kind; ``handler``: ``build_report``, as the site wraps it
    (``permits.jobkinds``: a failure that may stop it asks for the stop notice)."""
    # The report reads applicant contacts: an exception's message could quote one, so its
    # failures keep class and frames only (DESIGN: no private field in an error field).
    register_kind(
        KIND,
        handler,
        authorize_release=authorize_release,
        redact_errors=True,
        labels=LABELS,
        # One sequence per permit request: a revision's report (and its notices) waits
        # until the previous revision's report ended and its notices settled.
        sequence=report_sequence,
    )
    for code, cause in CAUSES.items():
        register_cause(code, cause, kind=KIND)
