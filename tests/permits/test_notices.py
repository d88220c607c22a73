"""Reviewer notices for every turn (issue 33): assigned, could not be built, revoked.

Each is its own job kind whose subject names the event, so asking twice is one job, and
its notice is one ledger row, rechecked at release. Deliveries run in this process
(``run_delivery``), a second delivery of the same job is a duplicate.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.test import Client
from django.utils import timezone

from jobs.delivery.runner import run_delivery
from jobs.models import Attempt, Effect, Job, Notice
from permits import notices
from permits.models import PermitRequest
from permits.services import assign_reviewer, report_request, revoke_reviewer
from permits.signals import OFFICE_ADMINS
from tests.permits import factories

pytestmark = pytest.mark.django_db
State = Job.State


@pytest.fixture
def office():
    return factories.tenant()


@pytest.fixture
def reviewer(make_user, office):
    user = make_user(username="note-reviewer")
    user.groups.add(Group.objects.get(name="reviewers"))
    office.members.add(user)
    return user


@pytest.fixture
def office_admin(make_user, office):
    user = make_user(username="note-admin", is_staff=True)
    user.groups.add(Group.objects.get(name=OFFICE_ADMINS))
    office.members.add(user)
    return user


def kind_jobs(kind: str):
    return Job.objects.filter(kind=kind).order_by("id")


def run(job: Job) -> str:
    return run_delivery(job.pk).outcome


def titles(user) -> list[str]:
    return list(
        Notice.objects.filter(recipient=user).order_by("id").values_list("title", flat=True)
    )


# --- "New request assigned to you" ---------------------------------------------------


def test_assigned__one_notice_per_grant_through_the_ledger(reviewer, office_admin, office):
    permit = factories.permit(office)
    assign_reviewer(permit, reviewer, by=office_admin, via="assign page")
    [job] = kind_jobs(notices.ASSIGNED)
    assert (job.subject_type, job.output_revision) == (notices.ASSIGNED_SUBJECT, 1)
    assert run(job) == "succeeded"
    assert run(job) == "duplicate"  # a redelivery adds nothing
    assert titles(reviewer) == [f"New request assigned to you: {permit.reference}"]
    [effect] = Effect.objects.filter(job=job)
    assert effect.effect_id == f"{job.uid}:1:assigned-notice:{reviewer.pk}"
    assert Notice.objects.get(recipient=reviewer).link == f"/requests/{permit.pk}/"
    # Assigning again is no new grant: no second job, no second notice.
    assign_reviewer(permit, reviewer, by=office_admin)
    assert kind_jobs(notices.ASSIGNED).count() == 1


def test_assigned__asked_twice_for_the_same_grant_is_one_job(reviewer, office_admin, office):
    permit = factories.permit(office)
    assign_reviewer(permit, reviewer, by=office_admin)
    record = permit.assignment_records.get()
    notices.ask_assigned_notice(record)
    notices.ask_assigned_notice(record)
    assert kind_jobs(notices.ASSIGNED).count() == 1


def test_assigned__the_systems_grants_are_silent(reviewer, office):
    factories.permit(office, reviewer=reviewer)  # the seed's way: by=None
    assert not kind_jobs(notices.ASSIGNED).exists()


def test_assigned__withheld_when_revoked_before_release(reviewer, office_admin, office):
    permit = factories.permit(office)
    assign_reviewer(permit, reviewer, by=office_admin)
    revoke_reviewer(permit, reviewer, by=office_admin)
    [job] = kind_jobs(notices.ASSIGNED)
    assert run(job) == "succeeded"
    [effect] = Effect.objects.filter(job=job)
    assert effect.state == Effect.State.WITHHELD
    assert not Notice.objects.filter(recipient=reviewer).exists()


# --- "Report could not be built" -----------------------------------------------------


def failing_report(permit: PermitRequest) -> Job:
    """A report that stops at once (validation: the request's office moved)."""
    job, _ = report_request(permit)
    Job.objects.filter(pk=job.pk).update(tenant_key="elsewhere")
    return job


def test_stopped__one_notice_per_reviewer_once(reviewer, make_user, office):
    other = make_user(username="note-reviewer-2")
    permit = factories.permit(office, reviewer=reviewer)
    assign_reviewer(permit, other)
    report = failing_report(permit)
    assert run(report) == Attempt.Outcome.FAILED
    [job] = kind_jobs(notices.STOPPED)
    assert (job.subject_type, job.subject_id, job.output_revision) == (
        "jobs.job",
        str(report.pk),
        1,
    )
    assert run(job) == "succeeded"
    assert run(job) == "duplicate"
    notices.ask_stopped_notice(report.pk)  # asked again: the same job
    assert kind_jobs(notices.STOPPED).count() == 1
    expected = (
        f"Report could not be built: {permit.reference} revision 1. "
        "The office has been told; nothing to do for you."
    )
    assert titles(reviewer) == [expected] and titles(other) == [expected]
    body = Notice.objects.filter(recipient=reviewer).values_list("title", "link").get()
    assert all(v not in str(body) for v in factories.PRIVATE.values())


def test_stopped__waits_while_the_attempt_is_unsettled_and_says_nothing_after_a_retry(
    reviewer, office
):
    permit = factories.permit(office, reviewer=reviewer)
    report, _ = report_request(permit)
    # The handler raised and the engine has not settled the attempt yet: the report is
    # still running with that attempt.
    Job.objects.filter(pk=report.pk).update(
        state=State.RUNNING,
        attempts=1,
        lease_owner="elsewhere",
        lease_expires_at=timezone.now() + timedelta(minutes=5),
    )
    notices.ask_stopped_notice(report.pk)
    [job] = kind_jobs(notices.STOPPED)
    assert run(job) == Attempt.Outcome.RETRY
    # It was tried again (a second attempt) instead: that stop notice tells nobody.
    Job.objects.filter(pk=report.pk).update(
        state=State.RETRY_WAIT, attempts=2, lease_owner="", lease_expires_at=None
    )
    Job.objects.filter(pk=job.pk).update(next_attempt_at=Job.objects.get(pk=job.pk).created_at)
    assert run(job) == "succeeded"
    assert not Effect.objects.filter(job=job).exists()
    assert not Notice.objects.filter(recipient=reviewer).exists()


def test_stopped__a_report_buried_at_its_claim_asks_for_the_notice(reviewer, office):
    permit = factories.permit(office, reviewer=reviewer)
    report, _ = report_request(permit)
    # Every attempt crashed (the worker died each time): the next claim buries it.
    Job.objects.filter(pk=report.pk).update(attempts=report.max_attempts)
    assert run(report) == "buried"
    assert Job.objects.get(pk=report.pk).state == State.DEAD
    [job] = kind_jobs(notices.STOPPED)
    assert job.output_revision == report.max_attempts
    assert run(job) == "succeeded"
    assert titles(reviewer)[0].startswith(f"Report could not be built: {permit.reference}")


def test_stopped__a_report_that_succeeds_asks_nothing(reviewer, office):
    permit = factories.permit(office, reviewer=reviewer)
    report, _ = report_request(permit)
    assert run(report) == "succeeded"
    assert not kind_jobs(notices.STOPPED).exists()


# --- revocation ----------------------------------------------------------------------


def test_revoked__notices_of_that_request_say_so_and_link_nowhere(reviewer, office_admin, office):
    permit = factories.permit(office)
    kept = factories.permit(office, reviewer=reviewer)
    assign_reviewer(permit, reviewer, by=office_admin)
    run(kind_jobs(notices.ASSIGNED).get())
    assert run(report_request(permit)[0]) == "succeeded"
    assert run(report_request(kept)[0]) == "succeeded"
    revoke_reviewer(permit, reviewer, by=office_admin)
    rows = dict(Notice.objects.filter(recipient=reviewer).values_list("title", "link"))
    assert rows == {
        f"No longer assigned: {permit.reference}": "",
        f"Report ready: {kept.reference} revision 1": f"/requests/{kept.pk}/",
    }
    client = Client()
    client.force_login(reviewer)
    inbox = client.get("/notices/").content.decode()
    assert f"/requests/{permit.pk}/" not in inbox and f"/requests/{kept.pk}/" not in inbox
    # Every notice still in the inbox leads to a page that answers 200.
    for notice in Notice.objects.filter(recipient=reviewer):
        assert client.get(f"/notices/{notice.pk}/", follow=True).status_code == 200


# --- only actions that can help ------------------------------------------------------


def test_rebuild__not_offered_on_a_stop_it_cannot_change(reviewer, office):
    permit = factories.permit(office, reviewer=reviewer, status=PermitRequest.Status.IN_REVIEW)
    report = failing_report(permit)
    run(report)
    client = Client()
    client.force_login(reviewer)
    page = client.get(f"/requests/{permit.pk}/").content.decode()
    assert 'id="rebuild-report"' not in page and "The office has been told" in page
    client.post(f"/requests/{permit.pk}/revisions/", {"seen_revision": 1})
    assert PermitRequest.objects.get(pk=permit.pk).output_revision == 1


def test_rebuild__offered_after_a_stop_whose_cause_may_have_passed(reviewer, office):
    permit = factories.permit(office, reviewer=reviewer, status=PermitRequest.Status.IN_REVIEW)
    report, _ = report_request(permit)
    Job.objects.filter(pk=report.pk).update(state=State.DEAD, last_error_class="transport")
    client = Client()
    client.force_login(reviewer)
    page = client.get(f"/requests/{permit.pk}/").content.decode()
    assert 'id="rebuild-report"' in page


def test_stopped__a_retried_failure_asks_nothing_until_the_last_try(reviewer, office, monkeypatch):
    from jobs.exceptions import TemporaryFailure
    from permits import reports

    def unavailable(permit, job):
        raise TemporaryFailure("a service is briefly away")

    monkeypatch.setattr(reports, "render_report", unavailable)
    permit = factories.permit(office, reviewer=reviewer)
    report, _ = report_request(permit)
    Job.objects.filter(pk=report.pk).update(max_attempts=2)
    assert run(report) == Attempt.Outcome.RETRY  # attempt 1 of 2: retried, nobody told
    assert not kind_jobs(notices.STOPPED).exists()
    Job.objects.filter(pk=report.pk).update(next_attempt_at=timezone.now() - timedelta(seconds=1))
    assert run(report) == Attempt.Outcome.DEAD  # the last try: the notice is asked for
    [job] = kind_jobs(notices.STOPPED)
    assert job.output_revision == 2
    assert run(job) == "succeeded"
    assert len(titles(reviewer)) == 1
