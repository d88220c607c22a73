"""The report kind: deterministic PDF, policy rechecks, release follows current authorization."""

from __future__ import annotations

import hashlib
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import call_command
from django.http import Http404

from jobs import services as job_services
from jobs.artifacts import open_artifact
from jobs.delivery.runner import run_delivery
from jobs.models import Artifact, Effect, Job, Notice
from permits import selectors
from permits.models import PermitRequest, Tenant
from permits.reports import compute_fees, render_report
from permits.services import assign_reviewer, report_request, revoke_reviewer
from tests.jobs.helpers import run_queued_effects
from tests.permits import factories

pytestmark = pytest.mark.django_db


def test_render_report__same_revision_gives_identical_bytes(make_user):
    permit = factories.permit(reviewer=make_user())
    job, _ = report_request(permit)
    first, second = render_report(permit, job), render_report(permit, job)
    assert first.startswith(b"%PDF") and first == second
    job.output_revision = 2
    assert render_report(permit, job) != first, "the revision is part of the report"


def test_compute_fees__new_building_has_plan_review_and_surcharge():
    permit = PermitRequest(
        work_type=PermitRequest.WorkType.NEW_BUILDING, valuation=Decimal("1250000")
    )
    lines = dict(compute_fees(permit))
    assert lines["Base fee"] == Decimal("500.00")
    assert lines["Valuation fee ($5.00 per $1,000)"] == Decimal("6250.00")
    assert lines["Plan review (65%)"] == Decimal("4387.50")
    assert lines["Technology surcharge (4%)"] == Decimal("445.50")
    assert lines["Total"] == Decimal("11583.00")


def test_report_job__stores_the_pdf_and_notifies_each_assigned_reviewer_once(make_user):
    first, second, stranger = make_user(), make_user(), make_user()
    permit = factories.permit(reviewer=first)
    assign_reviewer(permit, second)
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "succeeded"
    artifact = Artifact.objects.get(job=job)
    assert artifact.content_type == "application/pdf"
    job.refresh_from_db()
    assert selectors.artifact_of(job) == artifact
    with open_artifact(artifact) as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == artifact.sha256
    effect_ids = set(Effect.objects.values_list("effect_id", flat=True))
    assert effect_ids == {
        f"{job.uid}:1:completion-notice:{first.pk}",
        f"{job.uid}:1:completion-notice:{second.pk}",
    }
    assert Notice.objects.filter(recipient=first).count() == 1
    assert Notice.objects.filter(recipient=second).count() == 1
    assert not Notice.objects.filter(recipient=stranger).exists()
    assert run_delivery(job.pk).outcome == "duplicate"
    assert Notice.objects.count() == 2


def test_revocation_mid_job__job_finishes_notice_withheld_download_refused(make_user):
    reviewer = make_user()
    permit = factories.permit(reviewer=reviewer)
    job, _ = report_request(permit)

    def revoke_while_running(stage, ctx):
        # Still running: the recipients are chosen, the notices not yet released.
        if stage == "before_publish":
            revoke_reviewer(permit, reviewer)

    assert run_delivery(job.pk, on_stage=revoke_while_running).outcome == "succeeded"
    assert Job.objects.get(pk=job.pk).state == Job.State.SUCCEEDED
    effect = Effect.objects.get(job=job)
    assert effect.state == Effect.State.WITHHELD
    assert effect.reason == "the recipient is no longer assigned to this request"
    assert not Notice.objects.exists()
    reviewer = type(reviewer).objects.get(pk=reviewer.pk)  # fresh permission cache
    with pytest.raises(Http404):
        selectors.request_for(reviewer, permit.pk)

    assign_reviewer(permit, reviewer)
    assert job_services.recheck_and_release(effect, operator="op1")
    assert (
        job_services.recheck_and_release(Effect.objects.get(pk=effect.pk), operator="op1") is False
    )
    assert run_queued_effects() == {effect.pk: Effect.State.APPLIED}, "a worker releases it"
    assert Notice.objects.filter(recipient=reviewer).count() == 1
    assert Effect.objects.get(pk=effect.pk).state == Effect.State.APPLIED


def test_report_job__withdrawn_request_is_not_read(make_user):
    permit = factories.permit(reviewer=make_user(), status=PermitRequest.Status.WITHDRAWN)
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "failed"
    job.refresh_from_db()
    # The report kind redacts errors: class and code only, even for the engine's own words.
    assert (job.last_error_class, job.last_error_detail) == ("authorization", "")
    assert job.last_error_code
    assert not Artifact.objects.exists() and not Effect.objects.exists()


def test_report_job__ownership_change_mid_job_stops_before_the_read(make_user):
    permit = factories.permit(reviewer=make_user())
    job, _ = report_request(permit)
    other = Tenant.objects.create(key="elsewhere", name="Elsewhere")
    PermitRequest.objects.filter(pk=permit.pk).update(tenant=other)
    assert run_delivery(job.pk).outcome == "failed"
    job.refresh_from_db()
    assert job.last_error_class == "authorization"
    assert job.attempts == 1, "authorization errors are not retried"


def test_request_report_command__prints_the_same_job_id_twice(make_user):
    permit = factories.permit(reviewer=make_user())
    outputs = []
    for _ in range(2):
        out = StringIO()
        call_command("request_report", str(permit.pk), stdout=out)
        outputs.append(out.getvalue().strip())
    assert outputs[0] == outputs[1] == str(Job.objects.get().pk)


def test_seed_demo__idempotent_with_job_84_at_revision_29():
    call_command("seed_demo", stdout=StringIO())
    call_command("seed_demo", stdout=StringIO())
    job = Job.objects.get(pk=84)
    assert (job.output_revision, job.subject_id, job.kind) == (29, "7", "permits.report")
    # One report per request in review, asked for by the seed's assignments; job 84 is
    # request 7's (revision 29); and the chain's first job of the seeded decision.
    assert PermitRequest.objects.count() == 12 and Job.objects.count() == 13
    assert run_delivery(84).outcome == "succeeded"
    assert Effect.objects.get(job_id=84).effect_id == f"{job.uid}:29:completion-notice:47"
    out = StringIO()
    call_command("request_report", "3", stdout=out)
    assert int(out.getvalue()) > 84, "sequences moved past the seeded ids"


def test_authorize_release__agrees_with_guardian_has_perm(make_user):
    """The one-query release check finds what ``user.has_perm(REVIEW_PERM, permit)`` finds."""
    from django.contrib.auth.models import Group
    from guardian.shortcuts import assign_perm

    from jobs.engine.effect_machine import effect_identity
    from permits.models import REVIEW_PERM
    from permits.reports import authorize_release

    direct, via_group, stranger, other_request = (make_user() for _ in range(4))
    superuser = make_user(is_superuser=True)
    permit = factories.permit(reviewer=direct)
    group = Group.objects.create(name="plan checkers")
    assign_perm(REVIEW_PERM, group, permit)
    via_group.groups.add(group)
    assign_perm(REVIEW_PERM, other_request, factories.permit())
    job, _ = report_request(permit)

    for user in (direct, via_group, stranger, other_request, superuser):
        effect = Effect(job=job, effect_id=effect_identity(job, "n", str(user.pk)))
        effect.recipient = str(user.pk)
        fresh = type(user).objects.get(pk=user.pk)
        expected = None if fresh.has_perm(REVIEW_PERM, permit) else "no longer assigned"
        reason = authorize_release(effect)
        assert (reason is None) == (expected is None), (user, reason)

    PermitRequest.objects.filter(pk=permit.pk).update(status=PermitRequest.Status.WITHDRAWN)
    effect = Effect(job=job, recipient=str(direct.pk))
    assert authorize_release(effect) == "the request was withdrawn"
