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

import jobs
from jobs.models import Artifact, Attempt, Effect, Job, Notice
from jobs.registry import kinds, register_kind
from permits import selectors
from permits.models import PermitRequest
from permits.services import revoke_reviewer
from tests.e2e import a11y
from tests.e2e.processes import wait_until
from tests.jobs.helpers import request_job, run_job

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
SEQ_KIND = "test.seq.axe"


def _fails_at_once(ctx) -> list:
    raise RuntimeError("the first job of its sequence fails")


if SEQ_KIND not in kinds():
    register_kind(SEQ_KIND, _fails_at_once, max_attempts=1, sequence=lambda p, s: "axe:1")


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
    # Every request in review had its report asked for by the seed: no button was pressed.
    mine = [p for p in PermitRequest.objects.filter(pk__in=[1, 2, 3, 4, 5, 7, 8])]
    wait_until(
        procs,
        "the seeded requests' reports to be built without a click",
        lambda: all(
            selectors.report_job(p) is not None and selectors.report_job(p).state == State.SUCCEEDED
            for p in mine
        ),
        timeout=90,
    )
    page.reload()
    expect(page.locator("text=Not requested")).to_have_count(0)
    shot(page, "1-queue")

    page.click("text=SPR-2026-0007")
    expect(page.locator("#report-panel h2")).to_have_text("Report · revision 29")
    expect(page.locator("#applicant")).to_contain_text("Demo Applicant 7")

    # Rebuild the report (after a confirmation), then watch the polled panel until it is ready.
    page.click("text=Rebuild report")
    expect(page.locator("h1")).to_have_text("Rebuild the report of SPR-2026-0007?")
    expect(page.locator("main")).to_contain_text("as revision 30")
    shot(page, "2-rebuild-confirm")
    started = time.monotonic()
    page.click("text=Rebuild report as revision 30")
    expect(page.locator(".banner")).to_contain_text("the report is now revision 30")
    expect(page.locator(".banner")).to_be_focused()
    # Survive only if the page and its live region are updated in place, not replaced.
    page.evaluate("window.__samePage = true")
    page.evaluate("document.getElementById('report-status').__sameRegion = true")
    # Rebuild is not offered and the decision waits while revision 30 is being prepared;
    # both come back only once a worker finished it (a fast machine can beat these lines).
    if page.locator("#rebuild-report").count() or page.locator("#id_comment").is_enabled():
        assert Job.objects.filter(
            kind="permits.report", output_revision=30, state=Job.State.SUCCEEDED
        ).exists(), "Rebuild offered or the decision open while the report is being prepared"
    page.focus("#notice-link")
    shot(page, "2a-detail-requested")
    state = page.locator("#report-panel [data-state]")
    expect(state).to_have_attribute("data-state", "succeeded", timeout=45_000)
    visible = time.monotonic() - started
    print(f"\nrequest report -> report visible in the browser: {visible:.2f} s")
    assert page.evaluate("window.__samePage") is True, "the page reloaded instead of polling"
    assert page.evaluate("document.getElementById('report-status').__sameRegion") is True
    assert page.evaluate("document.activeElement.id") == "notice-link", "focus moved"
    expect(page.locator("#report-panel h2")).to_have_text("Report · revision 30")
    expect(page.locator("#report-status")).to_contain_text("The report is ready to download.")
    expect(page.locator(".timeline")).to_contain_text("Ready")
    expect(page.locator("#id_comment")).to_be_enabled()  # opened in place
    expect(page.locator("#unread-count")).to_have_text("8")  # updated by the poll too
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

    # A decision without a reason: the error summary takes focus and leads to the field.
    page.check("input[name=decision][value=reject]")
    page.click("text=Record decision")
    summary = page.locator(".error-summary")
    expect(summary).to_be_focused()
    expect(summary).to_contain_text("There is a problem")
    assert page.title().startswith("Error: ")
    expect(page.locator("#comment-error")).to_contain_text(
        "Say why you reject: the applicant needs a reason."
    )
    shot(page, "2c-decision-error")
    summary.locator("a").click()
    expect(page.locator("#id_comment")).to_be_focused()
    page.fill("#id_comment", "The setbacks are not shown.")
    page.click("text=Record decision")
    expect(page.locator(".banner")).to_be_focused()
    expect(page.locator(".banner")).to_contain_text("Decision recorded: “Reject” on revision 30.")
    expect(page.locator("#decision-form")).to_have_count(0)  # recorded: no second form
    expect(page.locator("#change-decision")).to_be_visible()
    shot(page, "2d-decision-recorded")

    # The inbox: exactly one notice for this report (and one for the seeded r29).
    page.click("#notice-link")
    items = page.locator(".inbox__item")
    expect(items).to_have_count(8)  # one per report: 7 requests, and revision 30
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
    # By id: the report's Steps heading ("later attempts reuse ...") also says attempts.
    expect(admin.locator("#attempt_set-heading")).to_be_visible()
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
    expect(admin.locator("#bulk-count")).to_have_text("1")  # the confirmation first
    admin.click("#bulk-confirm")
    expect(admin.locator(".messagelist")).to_contain_text("Requeued 1 of 1 selected.")
    shot(admin, "6-admin-requeue-action")
    # (No state assertion here: a worker may already have spent the fresh budget again.)
    wait_until(
        procs,
        f"a worker to take requeued job {doomed.pk} again",
        # A requeue grows the budget, so the numbers go on (4, 5, ...), never back to 1.
        lambda: Attempt.objects.filter(job=doomed, number__gt=3).exclude(pk__in=before).exists(),
        timeout=30,
    )
    # The requeued job fails again: once it is dead its page has nothing live (an open page
    # of an unfinished job reloads itself when the job ends, which a screenshot would race).
    wait_until(
        procs,
        f"requeued job {doomed.pk} to die again",
        lambda: Job.objects.get(pk=doomed.pk).state == State.DEAD,
        timeout=60,
    )
    admin.goto(f"{base}/admin/jobs/job/{doomed.pk}/change/")
    expect(admin.locator(".jobs-operate__log")).to_contain_text("operator: Requeue: dead →")
    tries = admin.locator("#attempt_set-group td.field-try_number").all_inner_texts()
    assert [t.strip() for t in tries if t.strip() != "—"][:4] == ["1", "2", "3", "4"], tries
    shot(admin, "7-admin-requeued-job")

    # The operations console, reached from the jobs list: live counts, the chart, a pause.
    admin.goto(f"{base}/admin/jobs/job/")
    admin.click("text=Operations console")
    expect(admin.locator("#jobs-chart polyline")).to_have_count(3)
    expect(admin.locator("#content-main")).to_contain_text("Duplicate effects")
    expect(admin.locator("#workers")).to_be_visible()
    stamp = admin.locator("#console-now").inner_text()
    expect(admin.locator("#console-now")).not_to_have_text(stamp, timeout=15_000)  # refreshed
    admin.click("#console-pause")
    expect(admin.locator("#console-pause")).to_have_attribute("aria-pressed", "true")
    shot(admin, "8-admin-dashboard")
    operator_context.close()


# --- accessibility and layout: every reviewer page and the jobs admin, desktop and phone -----


def _demo_with_every_kind_of_row(operator) -> None:
    """Seeded demo plus a finished report, a dead job, a waiting one and a withheld notice."""
    from jobs.models import Effect
    from permits.services import report_request

    call_command("seed_demo", stdout=io.StringIO())
    run_job(84)
    # The seed asked for every report; build those the decision pages use (1 stays
    # queued: the panel polls and its decision form waits).
    for pk in (3, 4, 5, 8):
        run_job(report_request(PermitRequest.objects.get(pk=pk))[0].pk)
    doomed, _ = request_job(
        "test.short",
        subject_type="auth.user",
        subject_id=operator.pk,
        params={"fail": {"always": "temporary"}},
    )
    for _ in range(3):
        Job.objects.filter(pk=doomed.pk).update(next_attempt_at=doomed.created_at)
        run_job(doomed.pk)
    Effect.objects.filter(job_id=84).update(state=Effect.State.NEEDS_REVIEW)
    # A sequence its failed first job holds (the console's Blocked sequences page).
    first = jobs.request(SEQ_KIND, ("axe", "first")).job
    jobs.request(SEQ_KIND, ("axe", "second"))
    run_job(first.pk)


def _reviewer_pages(page, base: str, width: str):
    """(name, action) pairs: each action leaves the browser on one reviewer page."""
    err_pk, done_pk = (3, 4) if width == "desktop" else (5, 8)

    def decision_error():
        page.goto(f"{base}/requests/{err_pk}/")
        page.check("input[name=decision][value=reject]")
        page.click("text=Record decision")

    def decision_recorded():
        page.goto(f"{base}/requests/{done_pk}/")
        page.check("input[name=decision][value=approve]")
        page.click("text=Record decision")

    return [
        ("queue", lambda: page.goto(f"{base}/")),
        ("detail-ready", lambda: page.goto(f"{base}/requests/7/")),
        ("detail-polling", lambda: page.goto(f"{base}/requests/1/")),
        ("decision-error", decision_error),
        ("decision-recorded", decision_recorded),
        ("decision-change", lambda: page.goto(f"{base}/requests/{done_pk}/?change=1")),
        ("rebuild-confirm", lambda: page.goto(f"{base}/requests/7/revisions/")),
        ("notices", lambda: page.goto(f"{base}/notices/")),
        ("not-found", lambda: page.goto(f"{base}/requests/10/")),  # another office's request
    ]


def _admin_pages(page, base: str):
    from jobs.models import Effect

    effect = Effect.objects.filter(job_id=84).first()
    doomed = Job.objects.get(kind="test.short")
    held = Job.objects.filter(kind=SEQ_KIND).order_by("pk").last()
    return [
        ("admin-jobs", f"{base}/admin/jobs/job/"),
        ("admin-job", f"{base}/admin/jobs/job/{doomed.pk}/change/"),
        ("admin-job-84", f"{base}/admin/jobs/job/84/change/"),
        ("admin-effects", f"{base}/admin/jobs/effect/"),
        ("admin-effect", f"{base}/admin/jobs/effect/{effect.pk}/change/"),
        ("admin-attempts", f"{base}/admin/jobs/attempt/"),
        ("admin-effect-events", f"{base}/admin/jobs/effectevent/"),
        ("admin-console", f"{base}/admin/jobs/job/dashboard/"),
        ("admin-sequences", f"{base}/admin/jobs/job/sequences/"),
        ("admin-job-held", f"{base}/admin/jobs/job/{held.pk}/change/"),
        ("admin-archived", f"{base}/admin/jobs/archivedjob/"),
    ]


def test_browser__pages_pass_axe_and_fit_a_phone(live_server, browser, settings):
    """axe-core on every reviewer page and the jobs admin at 1366x900 and 390x844: no
    serious or critical violation; reviewer pages never scroll sideways at 390 px."""
    # The demo's jobs run in this process beside Chromium and the live server: the suite's
    # 2 s lease gives a transaction 0.5 s idle, which a loaded CI machine overran once.
    settings.JOBS_LEASE_SECONDS = 30
    _demo_with_every_kind_of_row(get_user_model().objects.create_user("e2e-subject"))
    base = live_server.url
    failures, counts = [], {}

    def check(page, width: str, name: str, *, fits: int | None = None) -> None:
        page.wait_for_load_state()
        shot(page, f"a11y-{width}-{name}")
        found = a11y.violations(page)
        counts[f"{width}/{name}"] = len(found)
        if a11y.blocking(found):
            failures.append(f"{width}/{name}: {a11y.describe(a11y.blocking(found))}")
        if fits is not None and a11y.scroll_width(page) > fits:
            failures.append(f"{width}/{name}: {a11y.scroll_width(page)} px wide > {fits}")

    for width, viewport in a11y.VIEWPORTS.items():
        fits = viewport["width"] if width == "phone" else None
        context = browser.new_context(viewport=viewport)
        page = context.new_page()
        page.set_default_timeout(20_000)
        page.goto(f"{base}/accounts/login/")
        check(page, width, "login", fits=fits)
        login(page, base, "/accounts/login/", "reviewer47", "reviewer-demo")
        for name, action in _reviewer_pages(page, base, width):
            action()
            check(page, width, name, fits=fits)
        context.close()

        context = browser.new_context(viewport=viewport)
        admin = context.new_page()
        admin.set_default_timeout(20_000)
        login(admin, base, "/admin/login/", "operator", "operator-demo")
        for name, url in _admin_pages(admin, base):
            assert admin.goto(url).status == 200, name
            check(admin, width, name)
        context.close()
    print("\naxe-core violations (all impacts) per page:", counts)
    assert not failures, "\n".join(failures)


def test_browser__live_region_keeps_its_identity_and_focus_across_polls(live_server, browser):
    from permits.services import assign_reviewer, report_request

    reviewer = get_user_model().objects.create_user("live-reviewer", password="live-pass-9")
    permit = PermitRequest.objects.create(
        tenant=_office(),
        reference="LIVE-0001",
        site_address="1 Live Street",
        parcel="P-1",
        work_type=PermitRequest.WorkType.ALTERATION,
        description="Alteration",
        valuation=1000,
        applicant_name="A",
        applicant_phone="1",
        applicant_email="a@example.org",
        applicant_id_number="1",
    )
    assign_reviewer(permit, reviewer)
    job, _ = report_request(permit)  # queued; no worker runs until the test says so
    context = browser.new_context(viewport=a11y.VIEWPORTS["phone"])
    page = context.new_page()
    page.set_default_timeout(20_000)
    login(page, live_server.url, "/accounts/login/", "live-reviewer", "live-pass-9")
    page.goto(f"{live_server.url}/requests/{permit.pk}/")
    expect = _expect()
    expect(page.locator("#report-status")).to_contain_text("waiting for its turn")
    expect(page.locator('[data-live="check-again"]')).to_be_hidden()  # JavaScript polls
    page.evaluate("document.getElementById('report-status').__marker = 'same element'")
    expect(page.locator("#id_comment")).to_be_disabled()  # the decision waits for the report
    page.focus("#notice-link")
    run_job(job.pk)  # the report is built while the page is open
    expect(page.locator("#report-panel [data-state]")).to_have_attribute("data-state", "succeeded")
    expect(page.locator("#report-status")).to_contain_text("The report is ready to download.")
    assert page.evaluate("document.getElementById('report-status').__marker") == "same element"
    assert page.evaluate("document.activeElement.id") == "notice-link"
    page.fill("#id_comment", "Typed once the report was ready")  # opened in place
    assert page.input_value("#id_comment") == "Typed once the report was ready"
    expect(page.locator("#download-report")).to_be_visible()
    context.close()


def test_browser__without_javascript_typed_input_survives_and_check_again_is_offered(
    live_server, browser
):
    from permits.services import report_request

    call_command("seed_demo", stdout=io.StringIO())
    job, _ = report_request(PermitRequest.objects.get(pk=3))  # queued by the seed, not run
    context = browser.new_context(java_script_enabled=False, viewport=a11y.VIEWPORTS["phone"])
    page = context.new_page()
    page.set_default_timeout(20_000)
    login(page, live_server.url, "/accounts/login/", "reviewer47", "reviewer-demo")
    page.goto(f"{live_server.url}/requests/3/")
    navigations = []
    page.on("framenavigated", lambda frame: navigations.append(frame.url))
    expect = _expect()
    expect(page.locator("#id_comment")).to_be_disabled()  # until the report is ready
    expect(page.locator("#decision-wait")).to_contain_text("being prepared now")
    page.wait_for_timeout(4_500)  # longer than the old 3-second meta refresh
    assert navigations == [], navigations
    expect(page.get_by_role("link", name="Check again")).to_be_visible()
    shot(page, "nojs-phone-detail")
    run_job(job.pk)
    page.get_by_role("link", name="Check again").click()
    page.check("input[name=decision][value=request_changes]")
    page.fill("#id_comment", "Please add the site plan.")
    page.click("text=Record decision")  # the form works without JavaScript too
    expect(page.locator(".banner")).to_contain_text("Decision recorded: “Request changes”")
    context.close()


def _expect():
    from playwright.sync_api import expect

    return expect


def _office():
    from permits.models import Tenant

    return Tenant.objects.get_or_create(key="live", defaults={"name": "Live Office"})[0]
