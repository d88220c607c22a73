"""The soak checker's artifact promise reads object names by the job's uid (issue 47)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.conf import settings
from django.core.files.base import ContentFile

from jobs import artifacts
from jobs.delivery.runner import run_delivery
from jobs.models import Job
from tests.chaos.checker import Report, one_artifact_per_job
from tests.jobs.helpers import new_job

pytestmark = pytest.mark.django_db


def test_one_artifact_per_job__a_killed_writers_file_of_an_unfinished_job_is_its_own(make_user):
    done, waiting = new_job(make_user()), new_job(make_user())
    assert run_delivery(done.pk, worker="w1").outcome == "succeeded"
    # A worker killed between storing the file and its publish: the job is claimable again.
    name = artifacts.storage_name_for(waiting, "txt", "0" * 64)
    artifacts.get_storage().save(name, ContentFile(b"unpublished"))
    history = SimpleNamespace(
        jobs={job.pk: job for job in Job.objects.all()},
        inp=SimpleNamespace(artifact_root=settings.STORAGES["artifacts"]["OPTIONS"]["location"]),
    )
    report = Report()
    one_artifact_per_job(history, report)
    assert report.passed, report.checks
    assert "1 of jobs that never succeeded" in report.checks[-1][3]
