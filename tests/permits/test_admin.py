"""Admin: operators see everything, reviewers only their requests, nobody edits engine state."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group
from django.core.management import call_command

from jobs.models import Job
from jobs.runner import run_delivery
from jobs.services import request_job
from permits.models import PermitRequest

pytestmark = pytest.mark.django_db


@pytest.fixture
def demo(client):
    call_command("seed_demo", verbosity=0, stdout=open("/dev/null", "w"))  # noqa: SIM115
    return client


def login(client, username):
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.get(username=username))
    return client


def test_permit_admin__reviewer_sees_only_assigned_requests(demo):
    client = login(demo, "reviewer47")
    page = client.get("/admin/permits/permitrequest/")
    assert page.status_code == 200
    mine = set(
        PermitRequest.objects.filter(pk__in=[1, 2, 3, 4, 5, 7, 8]).values_list(
            "reference", flat=True
        )
    )
    others = set(
        PermitRequest.objects.exclude(reference__in=mine).values_list("reference", flat=True)
    )
    body = page.content.decode()
    assert all(ref in body for ref in mine)
    assert not any(ref in body for ref in others)


def test_permit_admin__other_tenants_request_is_404_for_a_reviewer(demo):
    client = login(demo, "reviewer47")
    assert client.get("/admin/permits/permitrequest/1/change/").status_code == 200
    assert client.get("/admin/permits/permitrequest/10/change/").status_code == 404
    assert client.get("/admin/permits/permitrequest/9999/change/").status_code == 404
    assert client.get("/admin/jobs/notice/").status_code == 403
    assert client.get("/admin/jobs/job/84/change/").status_code == 403


def test_permit_admin__reviewer_cannot_edit_a_request(demo):
    client = login(demo, "reviewer47")
    response = client.post("/admin/permits/permitrequest/1/change/", {"reference": "X"})
    assert response.status_code == 403
    assert PermitRequest.objects.get(pk=1).reference != "X"


def test_permit_admin__operator_sees_all_and_the_current_report(demo):
    run_delivery(84)
    client = login(demo, "operator")
    body = client.get("/admin/permits/permitrequest/").content.decode()
    assert all(ref in body for ref in PermitRequest.objects.values_list("reference", flat=True))
    detail = client.get("/admin/permits/permitrequest/7/change/").content.decode()
    assert "job 84, revision 29: Succeeded" in detail
    assert "/admin/jobs/job/84/change/" in detail


def test_job_admin__operator_sees_attempts_and_effects_but_cannot_edit(demo):
    run_delivery(84)
    client = login(demo, "operator")
    page = client.get("/admin/jobs/job/84/change/").content.decode()
    assert "84:29:completion-notice:47" in page and "succeeded" in page
    response = client.post("/admin/jobs/job/84/change/", {"state": "queued"})
    assert response.status_code == 403
    assert Job.objects.get(pk=84).state == Job.State.SUCCEEDED


def test_job_admin__requeue_action_revives_a_dead_job_through_transitions(demo):
    job, _ = request_job(
        "test.short",
        subject_type="auth.user",
        subject_id=1,
        params={"fail": {"always": "temporary"}},
    )
    for _ in range(3):
        Job.objects.filter(pk=job.pk).update(next_attempt_at=job.created_at)
        run_delivery(job.pk)
    assert Job.objects.get(pk=job.pk).state == Job.State.DEAD
    client = login(demo, "operator")
    response = client.post(
        "/admin/jobs/job/", {"action": "requeue", "_selected_action": [job.pk]}, follow=True
    )
    assert "Requeued 1 of 1 selected." in response.content.decode()
    job.refresh_from_db()
    assert (job.state, job.attempts, job.version) == (Job.State.QUEUED, 0, 7)


def test_groups__exist_after_migrate():
    assert set(Group.objects.values_list("name", flat=True)) >= {"reviewers", "operators"}
    operators = Group.objects.get(name="operators")
    assert operators.permissions.filter(codename="view_job").exists()
