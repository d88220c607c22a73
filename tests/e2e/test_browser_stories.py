"""Issue 21's two stories in a real headless Chromium, at 1366x900 and 390x844.

The reviewer: a newly assigned request has its report without a click; the decision is
disabled while the report is being prepared and opens in place when it is ready; the
report opens inline; the decision is recorded; the request moves to "Decided".
The operator: a handler bug kills report jobs; the console's first line says failing
with the reason and lists them with the error; the job page shows state, error and
attempts first; a filtered bulk requeue confirms with the count and a sample; audit rows.

axe-core runs on every page visited (0 serious or critical), reviewer pages must
not scroll sideways at 390 px nor any page at 1366 px, and every page is
screenshotted to ``var/screenshots/`` (``story-<width>-<page>.png``) for a person to
look at. Workers are run in-process (``run_job``, a delivery at a time) so each step's
state is the one the test means.
"""

from __future__ import annotations

import io

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.core.management import call_command

from jobs.models import Job, JobEvent
from permits import reports, selectors, services
from permits.models import PermitRequest, Tenant
from tests.e2e import a11y
from tests.e2e.test_browser import browser, login, shot  # noqa: F401 (fixture)
from tests.jobs.helpers import run_job

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
WIDTHS = list(a11y.VIEWPORTS)


class Checks:
    """axe-core and the width check on every page, a screenshot of each, failures kept."""

    def __init__(self, width: str):
        self.width, self.failures, self.counts = width, [], {}

    def __call__(self, page, name: str, *, fits: bool = True) -> None:
        page.wait_for_load_state()
        shot(page, f"story-{self.width}-{name}")
        found = a11y.violations(page)
        self.counts[name] = [f"{v['id']}:{v['impact']}" for v in found]
        if a11y.blocking(found):
            self.failures.append(f"{self.width}/{name}: {a11y.describe(a11y.blocking(found))}")
        limit = a11y.VIEWPORTS[self.width]["width"]
        # ``fits=False``: an admin page may scroll sideways on a phone (Django's own
        # tables do); on a desktop every page fits.
        if (fits or self.width != "phone") and a11y.scroll_width(page) > limit:
            self.failures.append(f"{self.width}/{name}: {a11y.scroll_width(page)} px > {limit}")

    def assert_clean(self) -> None:
        print(f"\naxe-core violations ({self.width}):", self.counts)
        assert not self.failures, "\n".join(self.failures)


def _expect():
    from playwright.sync_api import expect

    return expect


@pytest.mark.parametrize("width", WIDTHS)
def test_story__reviewer_gets_the_report_without_a_click_then_decides(
    live_server,
    browser,  # noqa: F811 (the fixture imported above)
    width,
):
    expect = _expect()
    call_command("seed_demo", stdout=io.StringIO())
    User = get_user_model()
    reviewer, desk = (
        User.objects.get(username="reviewer47"),
        User.objects.get(username="officeadmin"),
    )
    permit = PermitRequest.objects.create(
        tenant=Tenant.objects.get(key="springfield"),
        reference="SPR-2026-0021",
        site_address="21 Story Street, Springfield",
        parcel="SP-2100-21",
        work_type=PermitRequest.WorkType.ADDITION,
        description="Rear addition: plans as submitted.",
        valuation=64000,
        applicant_name="Story Applicant",
        applicant_phone="+1 555 0121",
        applicant_email="story@example.org",
        applicant_id_number="ID-021",
    )
    services.enter_review(permit)  # the office puts it into review ...
    services.assign_reviewer(permit, reviewer, by=desk, via="admin")  # ... and assigns it
    job = selectors.report_job(permit)
    assert job is not None and job.state == Job.State.QUEUED  # asked for, nobody clicked

    check = Checks(width)
    context = browser.new_context(viewport=a11y.VIEWPORTS[width])
    page = context.new_page()
    page.set_default_timeout(20_000)
    login(page, live_server.url, "/accounts/login/", "reviewer47", "reviewer-demo")
    expect(page.locator("h1")).to_have_text("My queue")
    row = page.locator("tr", has=page.locator("a.ref", has_text="SPR-2026-0021"))
    expect(row).to_contain_text("Requested")
    expect(page.locator("text=Not requested")).to_have_count(0)
    check(page, "queue")
    page.fill("#queue-q", "0021")
    page.locator("#queue-q").press("Enter")
    expect(page.locator("a.ref")).to_have_count(1)
    check(page, "queue-search")

    # On a phone the whole card is the link: a click on its "Site" line opens it.
    if width == "phone":
        site = page.locator("td[data-label=Site]").first.bounding_box()
        with page.expect_navigation():
            page.mouse.click(site["x"] + site["width"] / 2, site["y"] + site["height"] / 2)
    else:
        page.click("text=SPR-2026-0021")
    expect(page.locator("#report-panel h2")).to_have_text("Report · revision 1")
    expect(page.locator("#id_comment")).to_be_disabled()  # the whole form, via its fieldset
    expect(page.locator("input[name=decision][value=approve]")).to_be_disabled()
    expect(page.locator("#decision-form button[type=submit]")).to_be_disabled()
    expect(page.locator("#decision-wait")).to_contain_text(
        "You can decide once the report of revision 1 is ready"
    )
    expect(page.locator("#rebuild-report")).to_have_count(0)  # not while it is prepared
    if width == "phone":
        jump = page.locator(".decide-jump a")
        expect(jump).to_be_visible()
        box = jump.bounding_box()
        assert box["y"] + box["height"] <= a11y.VIEWPORTS[width]["height"] + 1, box
    check(page, "detail-preparing")

    page.evaluate("window.__samePage = true")
    run_job(job.pk)  # a worker builds it while the page is open
    expect(page.locator("#report-panel [data-state]")).to_have_attribute(
        "data-state", "succeeded", timeout=20_000
    )
    expect(page.locator("#id_comment")).to_be_enabled()
    expect(page.locator("#decision-form button[type=submit]")).to_be_enabled()
    expect(page.locator("#decision-wait")).to_be_hidden()
    expect(page.locator("#rebuild-report")).to_be_visible()
    assert page.evaluate("window.__samePage") is True  # opened in place, no reload
    check(page, "detail-ready")

    # The report opens inline in the browser's PDF viewer; the download link is beside it.
    opened = page.locator("#open-report")
    expect(opened).to_have_attribute("target", "_blank")
    response = context.request.get(live_server.url + opened.get_attribute("href"))
    assert response.status == 200
    assert response.headers["content-type"] == "application/pdf"
    assert response.headers["content-disposition"].startswith("inline; ")
    assert response.body().startswith(b"%PDF")
    download = context.request.get(
        live_server.url + page.locator("#download-report").get_attribute("href")
    )
    assert download.headers["content-disposition"].startswith("attachment; ")

    if width == "phone":
        page.locator(".decide-jump a").click()
        expect(page.locator("#decision")).to_be_in_viewport()
    page.check("input[name=decision][value=approve]")
    page.click("text=Record decision")
    expect(page.locator(".banner")).to_contain_text("Decision recorded: “Approve” on revision 1.")
    check(page, "decision-recorded")

    page.goto(f"{live_server.url}/?view=decided")
    expect(page.locator("a.ref", has_text="SPR-2026-0021")).to_have_count(1)
    check(page, "queue-decided")
    page.goto(f"{live_server.url}/")
    expect(page.locator("a.ref", has_text="SPR-2026-0021")).to_have_count(0)
    expect(page.locator("nav.nav")).not_to_contain_text("Admin")  # no admin duties
    page.goto(f"{live_server.url}/no-such-page/")
    expect(page.locator("h1")).to_have_text("Not found")
    check(page, "not-found")
    context.close()
    check.assert_clean()


def _kill_report_jobs(permits: list[int]) -> list[Job]:
    """A handler bug (KeyError 'pool') on every report, run until the jobs are dead."""

    def broken(permit, job):
        raise KeyError("pool")

    with pytest.MonkeyPatch.context() as patch:  # its own: the browser fixture's stays
        patch.setattr(reports, "render_report", broken)
        return _run_until_dead(permits)


def _run_until_dead(permits: list[int]) -> list[Job]:
    dead = []
    for pk in permits:
        job = selectors.report_job(PermitRequest.objects.get(pk=pk))
        for _ in range(20):
            Job.objects.filter(pk=job.pk).update(next_attempt_at=job.created_at)
            run_job(job.pk)
            job.refresh_from_db()
            if job.state == Job.State.DEAD:
                break
        assert job.state == Job.State.DEAD, job.state
        dead.append(job)
    return dead


@pytest.mark.parametrize("width", WIDTHS)
def test_story__operator_sees_failing_then_bulk_requeues_with_confirmation(
    live_server,
    browser,  # noqa: F811 (the fixture imported above)
    width,
):
    expect = _expect()
    call_command("seed_demo", stdout=io.StringIO())
    dead = _kill_report_jobs([1, 2, 3])
    check = Checks(width)
    context = browser.new_context(viewport=a11y.VIEWPORTS[width])
    page = context.new_page()
    page.set_default_timeout(20_000)
    login(page, live_server.url, "/admin/login/", "operator", "operator-demo")
    expect(page.locator("#site-name")).to_contain_text("Permit review · operations")
    check(page, "admin-index", fits=False)

    page.click("text=Operations console")
    expect(page.locator("#health-status")).to_have_text("Failing")
    rate = page.locator('[data-reason="failure-rate"]')
    expect(rate).to_have_attribute("data-level", "bad")
    expect(rate).to_contain_text("Problem")
    expect(rate).to_contain_text("of tries failed in the last 5 min")
    failures = page.locator("#failures")
    for job in dead:
        expect(failures.locator(f'a[href$="/jobs/job/{job.pk}/change/"]')).to_have_count(1)
    expect(failures).to_contain_text("permits.report")
    expect(failures).to_contain_text("SPR-2026-0001")  # the subject through the site's hook
    expect(failures).to_contain_text("KeyError")
    check(page, "console", fits=False)

    failures.locator(f'a[href$="/jobs/job/{dead[0].pk}/change/"]').click()
    expect(page.locator(".field-state_word")).to_contain_text("dead")
    expect(page.locator(".field-error_message")).to_contain_text("KeyError")
    expect(page.locator("#attempt_set-group")).to_be_visible()
    # The engine's fields come folded, after the attempts.
    engine = page.locator("fieldset.collapse, details", has_text="Lease owner")
    expect(engine.first).to_be_attached()
    check(page, "job-dead", fits=False)

    # One job first: the confirmation previews it, then the page follows the outcome.
    page.click("#operate-requeue")
    expect(page.locator("#operate-preview")).to_contain_text(f"Requeue job {dead[0].pk} (dead")
    check(page, "requeue-confirm", fits=False)
    page.click("#operate-confirm")
    expect(page.locator("#jobs-follow")).to_contain_text("Now queued")
    check(page, "job-following", fits=False)

    # The rest by filter: kind + state + error class, all matching selected.
    page.goto(
        f"{live_server.url}/admin/jobs/job/?kind=permits.report&state__exact=dead"
        "&last_error_class=unknown"
    )
    expect(page.locator("#result_list tbody tr")).to_have_count(2)
    check(page, "jobs-filtered", fits=False)
    page.check("#action-toggle")
    page.select_option("select[name=action]", "requeue")
    page.click("button[name=index]")
    expect(page.locator("#bulk-count")).to_have_text("2")
    expect(page.locator("#bulk-sample")).to_contain_text("KeyError")
    check(page, "bulk-confirm", fits=False)
    page.click("#bulk-confirm")
    expect(page.locator(".messagelist")).to_contain_text("Requeued 2 of 2 selected.")
    check(page, "bulk-done", fits=False)

    for job in dead:
        job.refresh_from_db()
        assert job.state == Job.State.QUEUED
        assert LogEntry.objects.filter(object_id=str(job.pk)).count() == 1
        assert (
            JobEvent.objects.filter(job=job, action="requeue", actor="operator:operator").count()
            == 1
        )
    # ... and one summary of the bulk action, listed under the jobs list.
    (summary,) = LogEntry.objects.filter(object_id=None, content_type__model="job")
    assert summary.object_repr.startswith("Bulk requeue: 2 jobs (")
    assert "error=unknown" in summary.object_repr
    expect(page.locator("#bulk-log")).to_contain_text("Bulk requeue: 2 jobs")
    page.goto(f"{live_server.url}/admin/no-such-page/")
    check(page, "admin-404", fits=False)
    context.close()
    check.assert_clean()
