"""Archived identities in the admin (issue 46): read-only, found by id, uid or subject."""

from __future__ import annotations

import pytest
from django.urls import reverse

from jobs import archive
from jobs.models import ArchivedJob
from tests.jobs.ops.test_redrive import operator
from tests.jobs.test_archive import WINDOW, _finished

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.testapp.urls")]


def test_archived_admin__finds_an_archived_job_by_id_uid_or_subject(client, make_user):
    job = _finished(subject=4242)
    assert archive.archive(older_than_days=WINDOW).jobs == 1
    record = ArchivedJob.objects.get(job_id=job.pk)
    client.force_login(operator(make_user, perms=("view_archivedjob",)))
    listing = reverse("admin:jobs_archivedjob_changelist")
    for term in (str(job.pk), str(job.uid), job.subject_id, "not-a-number-or-uuid"):
        page = client.get(listing, {"q": term})
        assert page.status_code == 200, term
        found = f">{job.pk}<" in page.content.decode()
        assert found == (term != "not-a-number-or-uuid"), term
    change = client.get(reverse("admin:jobs_archivedjob_change", args=[record.pk]))
    assert change.status_code == 200 and job.subject_id in change.content.decode()
    assert b'type="submit"' not in change.content or b'name="_save"' not in change.content
