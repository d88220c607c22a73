"""The applicant's decision letter (issue 44): a reviewer's decision asks for a chain of two
jobs, ``permits.decision`` (waits for the decided revision's report) then the letter on the
``heavy`` queue; seeded by ``seed_demo`` (reviewer52's approval of request 11)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from jobs.models import Artifact, Effect, Job, JobStep, Notice
from jobs.ops import causes
from permits import letters, reports, services
from permits.management.commands.seed_demo import DECIDED_PERMIT_ID
from permits.models import PermitRequest, ReviewDecision
from tests.jobs.helpers import run_job, run_queued_effects
from tests.permits.test_admin import demo  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db


def report_job(permit: PermitRequest) -> Job:
    return Job.objects.get(
        kind=reports.KIND, subject_id=str(permit.pk), output_revision=permit.output_revision
    )


def due_now(job: Job) -> None:
    """A retry's backoff over (the test does not wait the seconds out)."""
    Job.objects.filter(pk=job.pk).update(next_attempt_at=timezone.now() - timedelta(seconds=1))


def decision_job(decision: ReviewDecision) -> Job:
    return Job.objects.get(
        kind=letters.DECISION, subject_type=letters.DECISION_SUBJECT, subject_id=str(decision.pk)
    )


def test_decision__asks_for_the_letter_after_the_report_on_the_heavy_queue(demo):  # noqa: F811
    reviewer = get_user_model().objects.get(username="reviewer47")
    permit = PermitRequest.objects.get(pk=1)
    decision, new = services.decide(permit, reviewer, decision="approve", comment="Fine.")
    assert new
    head = decision_job(decision)
    assert (head.state, head.queue, head.tenant_key) == ("queued", "default", "springfield")

    # The report of the decided revision is not stored yet: the check waits (a retry).
    assert run_job(head.pk).outcome == "retry"
    head.refresh_from_db()
    assert (head.state, head.last_error_code) == ("retry_wait", "report_pending")
    assert "waits for the report" in causes.plain_words(head)
    assert not Job.objects.filter(parent=head).exists(), "no letter before the report"

    assert run_job(report_job(permit).pk).outcome == "succeeded"
    due_now(head)
    assert run_job(head.pk).outcome == "succeeded"
    letter = Job.objects.get(parent=head)
    assert (letter.kind, letter.queue, letter.params) == (
        letters.LETTER,
        letters.QUEUE,
        {"decision": decision.pk},
    )
    check = JobStep.objects.get(job=head, name="check").output
    assert check["decision"] == decision.pk and check["report_job"] == report_job(permit).pk

    assert run_job(letter.pk).outcome == "succeeded"
    letter.refresh_from_db()
    artifact = Artifact.objects.get(job=letter)
    assert artifact.content_type == "application/pdf" and artifact.size > 500
    steps = JobStep.objects.filter(job=letter).order_by("id")
    assert [s.name for s in steps] == ["render", "store"]
    assert (letter.progress_done, letter.progress_total, letter.progress_note) == (2, 2, "stored")
    run_queued_effects()
    notice = Notice.objects.get(recipient=reviewer, effect__job=letter)
    assert notice.title == f"Decision letter ready: {permit.reference} revision 1"
    # References only outside the PDF: no applicant data in steps, effects or notices.
    recorded = [str(s.output) for s in JobStep.objects.filter(job__in=[head, letter])]
    recorded += [str(e.data) for e in Effect.objects.filter(job=letter)] + [notice.title]
    for value in (permit.applicant_name, permit.applicant_phone, permit.site_address):
        assert not any(value in text for text in recorded)


def test_decision__asked_twice_is_one_chain(demo):  # noqa: F811
    reviewer = get_user_model().objects.get(username="reviewer47")
    permit = PermitRequest.objects.get(pk=2)
    first, _ = services.decide(permit, reviewer, decision="approve")
    again, new = services.decide(permit, reviewer, decision="approve")
    assert again.pk == first.pk and not new
    assert Job.objects.filter(kind=letters.DECISION, subject_id=str(first.pk)).count() == 1


def test_decision__a_decision_changed_before_its_letter_gets_none(demo):  # noqa: F811
    reviewer = get_user_model().objects.get(username="reviewer47")
    permit = PermitRequest.objects.get(pk=1)
    assert run_job(report_job(permit).pk).outcome == "succeeded"
    first, _ = services.decide(permit, reviewer, decision="approve")
    assert run_job(decision_job(first).pk).outcome == "succeeded"
    letter = Job.objects.get(parent=decision_job(first))
    permit.refresh_from_db()
    changed, _ = services.decide(
        permit, reviewer, decision="reject", comment="Setbacks missing.", replaces=first.pk
    )
    assert run_job(letter.pk).outcome == "failed"
    letter.refresh_from_db()
    assert letter.last_error_code == "decision_changed"
    assert not causes.requeue_helps(letter)
    assert "changed the decision" in causes.plain_words(letter)
    # The change has its own chain, and its letter.
    head = decision_job(changed)
    assert run_job(head.pk).outcome == "succeeded"
    assert run_job(Job.objects.get(parent=head).pk).outcome == "succeeded"


def test_seed_demo__the_decided_request_has_its_chain_on_the_heavy_queue(demo):  # noqa: F811
    decision = ReviewDecision.objects.get(request_id=DECIDED_PERMIT_ID)
    head = decision_job(decision)
    permit = PermitRequest.objects.get(pk=DECIDED_PERMIT_ID)
    assert permit.status == PermitRequest.Status.APPROVED
    assert run_job(report_job(permit).pk).outcome == "succeeded"
    assert run_job(head.pk).outcome == "succeeded"
    letter = Job.objects.get(parent=head)
    assert letter.queue == "heavy"
    assert run_job(letter.pk).outcome == "succeeded"


def test_request_page__the_reviewer_reads_where_the_letter_stands(demo):  # noqa: F811
    from tests.permits.test_admin import login

    reviewer = get_user_model().objects.get(username="reviewer47")
    permit = PermitRequest.objects.get(pk=1)
    client = login(demo, "reviewer47")
    decision, _ = services.decide(permit, reviewer, decision="approve")

    def row() -> str:
        page = client.get(f"/requests/{permit.pk}/").content.decode()
        start = page.index('id="decision-letter"')
        return page[start : page.index("</div>", start)]

    assert "Being prepared" in row()
    assert run_job(decision_job(decision).pk).outcome == "retry"
    assert "Waits for the report of this revision" in row()
    assert run_job(report_job(permit).pk).outcome == "succeeded"
    due_now(decision_job(decision))
    assert run_job(decision_job(decision).pk).outcome == "succeeded"
    assert "Being prepared" in row()
    assert run_job(Job.objects.get(parent=decision_job(decision)).pk).outcome == "succeeded"
    assert "Ready for the office to send" in row()
    # Another reviewer's page of a request they do not review: no page, no letter.
    other = login(demo.__class__(), "reviewer52")
    assert other.get(f"/requests/{permit.pk}/").status_code == 404
