"""The reviewer pages and the admin in a real headless Chromium, against real workers.

One test walks the whole story on PostgreSQL: pytest-django's live server
serves the site, a real ``manage.py qcluster`` and ``manage.py jobs_dispatcher``
run as subprocesses on the test database, and Playwright drives Debian's
Chromium (``/usr/bin/chromium``; Playwright's own browser download is never
used). Screenshots land in ``var/screenshots/`` for a person to look at.

Waits are generous deadlines that fail with the subprocesses' logs; the only
duration printed is the one a reviewer feels: "request report" to "report visible".
"""

from __future__ import annotations

import hashlib
import io
import re
import time
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connections

from jobs.models import Artifact, Attempt, Effect, Job, Notice
from jobs.services import request_job
from permits import selectors
from permits.models import PermitRequest
from permits.services import revoke_reviewer
from tests.e2e.processes import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "var" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
State = Job.State


# --- subprocesses (the approach of test_qcluster.py: own process groups, killed first) --


@pytest.fixture
def browser(monkeypatch):
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread; the ORM calls the
    # test makes between browser steps are plain synchronous code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
            # While Playwright's loop is set on this thread, asgiref keeps Django's
            # connections in a context-local store apart from the thread's: close the
            # ones the test body opened, or the test database cannot be dropped.
            connections.close_all()


def login(page, base: str, path: str, username: str, password: str, screenshot: str = "") -> None:
    page.goto(base + path)
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    if screenshot:
        shot(page, screenshot)
    with page.expect_navigation():
        page.locator("input[name=password]").press("Enter")


def shot(page, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


# --- the story -----------------------------------------------------------------------


def test_browser__reviewer_gets_one_report_and_notice_then_loses_access(
    live_server, procs, browser
):
    from playwright.sync_api import expect

    call_command("seed_demo", stdout=io.StringIO())
    User = get_user_model()
    reviewer = User.objects.get(username="reviewer47")
    operator = User.objects.get(username="operator")
    permit = PermitRequest.objects.get(reference="SPR-2026-0007")
    assert permit.output_revision == 29
    # A job that always fails temporarily, with a budget of 3: the real worker buries it.
    doomed, _ = request_job(
        "test.short",
        subject_type="auth.user",
        subject_id=operator.pk,
        tenant_key="e2e",
        params={"fail": {"always": "temporary"}},
    )
    procs.start("qcluster", "qcluster")
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.5")
    base = live_server.url

    # Reviewer 47: log in, the queue, the request.
    reviewer_context = browser.new_context(
        accept_downloads=True, viewport={"width": 1280, "height": 900}
    )
    page = reviewer_context.new_page()
    page.set_default_timeout(20_000)
    login(page, base, "/accounts/login/", "reviewer47", "reviewer-demo", "0-login")
    expect(page.locator("h1")).to_have_text("My queue")
    expect(page.locator("a.ref")).to_have_count(7)
    # The seeded job 84 (revision 29) runs first; its notice is the one already there.
    wait_until(
        procs,
        "seeded job 84 to succeed and notify",
        lambda: Notice.objects.filter(effect__job_id=84).exists(),
        timeout=45,
    )
    page.reload()
    shot(page, "1-queue")

    page.click("text=SPR-2026-0007")
    expect(page.locator("#report-panel h2")).to_have_text("Report · revision 29")
    expect(page.locator("#applicant")).to_contain_text("Demo Applicant 7")

    # Request a new revision, then watch the polled panel until the report is ready.
    started = time.monotonic()
    page.click("text=Request a new revision")
    expect(page.locator(".flash")).to_contain_text("Revision 30 requested")
    page.evaluate("window.__samePage = true")  # survives only if the panel updates in place
    shot(page, "2a-detail-requested")
    state = page.locator("#report-panel [data-state]")
    expect(state).to_have_attribute("data-state", "succeeded", timeout=45_000)
    visible = time.monotonic() - started
    print(f"\nrequest report -> report visible in the browser: {visible:.2f} s")
    assert page.evaluate("window.__samePage") is True, "the page reloaded instead of polling"
    expect(page.locator("#report-panel h2")).to_have_text("Report · revision 30")
    expect(page.locator(".timeline")).to_contain_text("— succeeded")
    expect(page.locator("#unread-count")).to_have_text("2")  # updated by the poll too
    shot(page, "2b-detail-ready")

    job = selectors.report_job(PermitRequest.objects.get(pk=permit.pk))
    assert (job.output_revision, job.state) == (30, State.SUCCEEDED)
    artifact = Artifact.objects.get(job=job)
    with page.expect_download() as download_info:
        page.click("#download-report")
    download = download_info.value
    assert download.suggested_filename == "SPR-2026-0007-r30.pdf"
    data = Path(download.path()).read_bytes()
    assert data.startswith(b"%PDF")
    assert hashlib.sha256(data).hexdigest() == artifact.sha256

    # A decision without a reason is refused with a sentence next to the field.
    page.check("input[name=decision][value=reject]")
    page.click("text=Record decision")
    expect(page.locator("#decision .field__error")).to_have_text(
        "Say why you reject: the applicant needs a reason."
    )
    shot(page, "2c-decision-error")

    # The inbox: exactly one notice for this report (and one for the seeded r29).
    page.click("#notice-link")
    items = page.locator(".inbox__item")
    expect(items).to_have_count(2)
    expect(items.filter(has_text="SPR-2026-0007 revision 30")).to_have_count(1)
    expect(items.filter(has_text="SPR-2026-0007 revision 29")).to_have_count(1)
    assert Notice.objects.filter(recipient=reviewer, effect__job=job).count() == 1
    shot(page, "3-inbox")

    # Revoked: the page and the download answer 404 at once, with the same session.
    detail_url = f"{base}/requests/{permit.pk}/"
    download_url = f"{base}/requests/{permit.pk}/report/"
    assert reviewer_context.request.get(download_url).status == 200
    revoke_reviewer(permit, reviewer)
    response = page.goto(detail_url)
    assert response.status == 404
    expect(page.locator("h1")).to_have_text("Not found")
    shot(page, "4-revoked-404")
    assert reviewer_context.request.get(download_url).status == 404
    assert reviewer_context.request.get(download_url + "?revision=29").status == 404
    reviewer_context.close()

    # The operator: the job with its attempts and effects, then requeue a dead job.
    operator_context = browser.new_context(viewport={"width": 1280, "height": 900})
    admin = operator_context.new_page()
    admin.set_default_timeout(20_000)
    login(admin, base, "/admin/login/", "operator", "operator-demo")
    admin.goto(f"{base}/admin/jobs/job/{job.pk}/change/")
    expect(admin.locator("h2", has_text="Attempts")).to_be_visible()
    expect(admin.locator("h2", has_text="Effects")).to_be_visible()
    expect(admin.locator("#attempt_set-group")).to_contain_text(re.compile("succeeded", re.I))
    effect = Effect.objects.get(job=job)
    effects = admin.locator("#effects-group")
    expect(effects).to_contain_text(effect.effect_id)
    expect(effects).to_contain_text(re.compile("applied", re.I))
    shot(admin, "5-admin-job")

    wait_until(
        procs,
        f"job {doomed.pk} to spend its 3 attempts and die",
        lambda: Job.objects.get(pk=doomed.pk).state == State.DEAD,
        timeout=45,
    )
    before = set(Attempt.objects.filter(job=doomed).values_list("pk", flat=True))
    admin.goto(f"{base}/admin/jobs/job/?state__exact=dead")
    admin.check(f"input[name=_selected_action][value='{doomed.pk}']")
    admin.select_option("select[name=action]", "requeue")
    admin.click("button[name=index]")
    expect(admin.locator(".messagelist")).to_contain_text("Requeued 1 of 1 selected.")
    shot(admin, "6-admin-requeue-action")
    doomed.refresh_from_db()
    assert doomed.state in (State.QUEUED, State.RUNNING, State.RETRY_WAIT), doomed.state
    wait_until(
        procs,
        f"a worker to take requeued job {doomed.pk} again",
        lambda: Attempt.objects.filter(job=doomed, number=1).exclude(pk__in=before).exists(),
        timeout=30,
    )
    admin.goto(f"{base}/admin/jobs/job/{doomed.pk}/change/")
    shot(admin, "7-admin-requeued-job")

    # The operator dashboard, reached from the jobs list: figures and the chart.
    admin.goto(f"{base}/admin/jobs/job/")
    admin.click("text=Dashboard")
    expect(admin.locator("#jobs-chart polyline")).to_have_count(3)
    expect(admin.locator("#content-main")).to_contain_text("Duplicate effects")
    shot(admin, "8-admin-dashboard")
    operator_context.close()
