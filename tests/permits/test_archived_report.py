"""A report whose job was archived (issue 46): the reviewer pages still show and serve it.

The archive keeps the artifact's file and its record names it (key, name, sha256): the
detail page says the report is ready, the download serves the published bytes after
their check, and asking for the report again returns the same job without a row.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import archive
from jobs.models import ArchivedJob, Artifact, Effect, Job, Notice
from permits.services import report_request
from tests.permits.test_views import body, client_for, finished_report, permit

pytestmark = pytest.mark.django_db


@pytest.fixture
def reviewer(make_user):
    return make_user(username="rev-archived")


def _archived_report(reviewer):
    p = permit(reviewer=reviewer)
    job = finished_report(p)
    artifact = Artifact.objects.get(job=job)
    # Its effects settled (the in-app notices stay in the inbox through the archive).
    Effect.objects.filter(job=job).update(state=Effect.State.APPLIED)
    Job.objects.filter(pk=job.pk).update(finished_at=timezone.now() - timedelta(days=400))
    assert archive.archive(older_than_days=365).jobs == 1
    return p, job, artifact


def test_archived_report__the_download_serves_the_published_bytes(reviewer):
    p, _job, artifact = _archived_report(reviewer)
    response = client_for(reviewer).get(f"/requests/{p.pk}/report/")
    assert response.status_code == 200
    assert hashlib.sha256(body(response)).hexdigest() == artifact.sha256


def test_archived_report__the_detail_page_shows_it_ready(reviewer):
    p, _job, _ = _archived_report(reviewer)
    response = client_for(reviewer).get(f"/requests/{p.pk}/")
    assert response.status_code == 200
    assert f"/requests/{p.pk}/report/" in response.content.decode()


def test_archived_report__asking_again_returns_the_same_job_without_a_row(reviewer):
    p, job, _ = _archived_report(reviewer)
    again, created = report_request(p)
    assert (again.pk, again.state, created, again.archived) == (job.pk, "succeeded", False, True)
    assert not Job.objects.filter(pk=job.pk).exists()
    assert ArchivedJob.objects.filter(job_id=job.pk).count() == 1


def test_archived_report__the_admin_change_page_says_archived(reviewer, make_user):
    p, job, _ = _archived_report(reviewer)
    admin = make_user(username="admin-archived", is_staff=True, is_superuser=True)
    response = client_for(admin).get(f"/admin/permits/permitrequest/{p.pk}/change/")
    assert response.status_code == 200
    page = response.content.decode()
    assert f"job {job.pk}, revision" in page and "(archived" in page
    assert client_for(admin).get("/admin/permits/permitrequest/").status_code == 200


def test_archived_report__the_reviewers_notice_stays_in_their_inbox(reviewer):
    p, job, _ = _archived_report(reviewer)
    assert not Effect.objects.filter(job_id=job.pk).exists(), "its effects were archived"
    notices = list(Notice.objects.filter(recipient=reviewer))
    assert [(n.effect_id, n.title) for n in notices] == [
        (None, f"Report ready: {p.reference} revision 1")
    ]
    page = client_for(reviewer).get("/notices/")
    assert page.status_code == 200 and notices[0].title in page.content.decode()
