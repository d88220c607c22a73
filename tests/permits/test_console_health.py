"""The console's first line (issue 21): healthy, degraded or failing, with the reasons;
dead and failed jobs listed with their error; reached from the admin index."""

from __future__ import annotations

import re

import pytest

from jobs.delivery.runner import run_delivery
from jobs.ops import console
from tests.permits.test_admin import dead_job, demo, login  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db


def _reasons(page: str) -> dict[str, str]:
    return dict(re.findall(r'data-reason="([\w-]+)" data-level="(\w+)"', page))


def test_health__healthy_when_nothing_failed_and_nothing_waits():
    snap = console.snapshot()
    health = console.health(snap)
    assert health.status == "healthy" and not health.problems


def test_health__failing_with_the_failure_rate_and_the_dead_job_listed(demo):  # noqa: F811
    job = dead_job()
    client = login(demo, "operator")
    page = client.get("/admin/jobs/job/dashboard/").content.decode()
    assert re.search(r'id="health-status">Failing<', page)
    reasons = _reasons(page)
    assert reasons["failure-rate"] == "bad"  # 3 of 3 tries failed
    assert "100% of tries failed in the last 15 min (3 of 3)" in page
    assert reasons["stopped"] == "warn" and "Problem" in page  # a text label, not colour alone
    failures = page[page.index('id="failures"') :]
    assert f'/admin/jobs/job/{job.pk}/change/">{job.pk}<' in failures
    assert "test.short" in failures and "temporary" in failures


def test_health__degraded_for_effects_needing_review(demo):  # noqa: F811
    from jobs.models import Effect

    run_delivery(84)
    Effect.objects.filter(job_id=84).update(state=Effect.State.NEEDS_REVIEW)
    from jobs.models import Job

    Job.objects.exclude(pk=84).delete()  # nothing waiting: only the review is a problem
    health = console.health(console.snapshot())
    assert health.status == "degraded"
    assert [r.key for r in health.problems] == ["needs-review"]


def test_admin_index__links_the_console_for_operators(demo):  # noqa: F811
    page = login(demo, "operator").get("/admin/").content.decode()
    assert 'href="/admin/jobs/job/dashboard/"' in page and "Operations console" in page
    assert "Permit review · operations" in page


def test_chart__completed_and_failed_per_minute_filtered_by_kind(demo):  # noqa: F811
    dead_job()
    run_delivery(84)
    client = login(demo, "operator")
    page = client.get("/admin/jobs/job/dashboard/").content.decode()
    assert re.search(r"1 jobs completed and 3 tries failed in the last 60 minutes", page)
    only = client.get("/admin/jobs/job/dashboard/?kind=test.short").content.decode()
    assert "0 jobs completed and 3 tries failed in the last 60 minutes for test.short" in only
    assert 'kind=test.short" data-interval-ms' in only  # the refresh keeps the filter


def test_search__jobs_by_error_and_effects_by_recipient_username(demo):  # noqa: F811
    job = dead_job()
    run_delivery(84)
    client = login(demo, "operator")
    found = client.get("/admin/jobs/job/?q=test_unavailable").content.decode()
    assert f"/admin/jobs/job/{job.pk}/change/" in found
    assert "/admin/jobs/job/84/change/" not in found
    effects = client.get("/admin/jobs/effect/?q=reviewer47").content.decode()
    assert "84:29:completion-notice:47" in effects
    assert (
        "84:29:completion-notice:47"
        not in client.get("/admin/jobs/effect/?q=reviewer52").content.decode()
    )
