"""Issue 33 in a real headless Chromium, at 1366x900 and 390x844 (and 1280x900).

The office admin: the request's admin page shows its reviewers and a visible "Assign
reviewers" action; the assign page offers only the office's reviewers; Revoke asks first,
naming the reviewer and what they lose; the assign page does not scroll sideways at
390 px. The reviewer: "New request assigned to you", and after the revocation an inbox
with no link to a 404. The request page with a ready report: the decision form beside
the report, its button visible without scrolling at 1366x900 and 1280x900.

axe-core runs on every page (0 serious or critical) and every page is screenshotted to
``var/screenshots/`` (``offices-<width>-<page>.png``). Workers run in-process
(``run_job``); tests/e2e/test_notices_browser.py runs real ones.
"""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management import call_command

from jobs.models import Job, Notice
from permits import notices, selectors
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

    def __call__(self, page, name: str) -> None:
        page.wait_for_load_state()
        shot(page, f"offices-{self.width}-{name}")
        found = a11y.violations(page)
        self.counts[name] = [f"{v['id']}:{v['impact']}" for v in found]
        if a11y.blocking(found):
            self.failures.append(f"{self.width}/{name}: {a11y.describe(a11y.blocking(found))}")
        limit = a11y.VIEWPORTS[self.width]["width"]
        if a11y.scroll_width(page) > limit:
            self.failures.append(f"{self.width}/{name}: {a11y.scroll_width(page)} px > {limit}")

    def assert_clean(self) -> None:
        print(f"\naxe-core violations ({self.width}):", self.counts)
        assert not self.failures, "\n".join(self.failures)


def _expect():
    from playwright.sync_api import expect

    return expect


def _seed():
    call_command("seed_demo", stdout=io.StringIO())
    User = get_user_model()
    # A reviewer of the other office: never offered for a Springfield request.
    stranger, _ = User.objects.get_or_create(username="reviewer-shelby")
    stranger.groups.add(Group.objects.get(name="reviewers"))
    Tenant.objects.get(key="shelbyville").members.add(stranger)
    return User.objects.get(username="reviewer47")


def _run_notices() -> None:
    for job in Job.objects.filter(kind=notices.ASSIGNED, state=Job.State.QUEUED):
        assert run_job(job.pk).outcome == "succeeded"


@pytest.mark.parametrize("width", WIDTHS)
def test_offices__assign_from_the_request_page_then_revoke_after_confirming(
    live_server,
    browser,  # noqa: F811 (the fixture imported above)
    width,
):
    expect = _expect()
    reviewer = _seed()
    permit = PermitRequest.objects.get(reference="SPR-2026-0006")  # reviewer52's
    base = live_server.url
    check = Checks(width)
    desk = browser.new_context(viewport=a11y.VIEWPORTS[width])
    page = desk.new_page()
    page.set_default_timeout(20_000)
    login(page, base, "/accounts/login/", "officeadmin", "officeadmin-demo")

    page.goto(f"{base}/admin/permits/permitrequest/{permit.pk}/change/")
    box = page.locator(".reviewers-box")
    expect(box).to_contain_text("Assigned now: reviewer52")
    expect(page.locator("#assign-reviewers")).to_be_visible()
    shot(page, f"offices-{width}-change")  # Django's change form: its own layout on a phone
    page.click("#assign-reviewers")
    expect(page.locator("h1")).to_contain_text("Assign reviewers")
    offered = page.locator("#id_reviewer option").all_inner_texts()
    assert "reviewer47" in offered and "reviewer-shelby" not in offered, offered
    check(page, "assign")
    page.select_option("#id_reviewer", label="reviewer47")
    page.locator("#assign-form input[type=submit]").click()
    expect(page.locator(".messagelist")).to_contain_text("now reviews SPR-2026-0006")
    _run_notices()
    assert list(
        Notice.objects.filter(recipient=reviewer, link=f"/requests/{permit.pk}/").values_list(
            "title", flat=True
        )
    ) == ["New request assigned to you: SPR-2026-0006"]

    page.click(f"#revoke-{reviewer.pk}")
    expect(page.locator("#content-main")).to_contain_text(
        "If you revoke reviewer47 from SPR-2026-0006"
    )
    expect(page.locator("#revoke-losses")).to_contain_text("applicant contacts")
    assert selectors.is_assigned(reviewer, permit)  # asked, not done
    check(page, "revoke-confirm")
    page.click("#confirm-revoke")
    expect(page.locator(".messagelist")).to_contain_text("no longer reviews SPR-2026-0006")
    check(page, "assign-after-revoke")
    assert not selectors.is_assigned(reviewer, permit)

    # The reviewer's inbox: the notice says so, and nothing in it leads to a 404.
    inbox = browser.new_context(viewport=a11y.VIEWPORTS[width]).new_page()
    login(inbox, base, "/accounts/login/", "reviewer47", "reviewer-demo")
    inbox.goto(f"{base}/notices/")
    expect(inbox.locator("[data-notice-gone]")).to_have_text("No longer assigned: SPR-2026-0006")
    check(inbox, "notices-after-revoke")
    links = inbox.locator("a[href^='/requests/']").evaluate_all("els => els.map(e => e.href)")
    for href in links:
        assert inbox.request.get(href).status == 200, href
    buttons = inbox.locator(".inbox__open button")
    for i in range(buttons.count()):
        inbox.goto(f"{base}/notices/")
        with inbox.expect_navigation():
            inbox.locator(".inbox__open button").nth(i).click()
        expect(inbox.locator("h1")).not_to_have_text("Not found")
    check.assert_clean()


@pytest.mark.parametrize("viewport", ["desktop", "phone", "1280"])
def test_request_page__the_decision_is_beside_a_ready_report(
    live_server,
    browser,  # noqa: F811
    viewport,
):
    expect = _expect()
    _seed()
    permit = PermitRequest.objects.get(reference="SPR-2026-0003")
    job = selectors.report_job(permit)
    assert run_job(job.pk).outcome == "succeeded"
    size = a11y.VIEWPORTS.get(viewport, {"width": 1280, "height": 900})
    width = viewport if viewport in a11y.VIEWPORTS else "desktop"
    page = browser.new_context(viewport=size).new_page()
    page.set_default_timeout(20_000)
    login(page, live_server.url, "/accounts/login/", "reviewer47", "reviewer-demo")
    page.goto(f"{live_server.url}/requests/{permit.pk}/")
    expect(page.locator("#open-report")).to_be_visible()
    assert "{#" not in page.inner_text("main") and "{%" not in page.inner_text("main")
    page.screenshot(path=str(_viewport_shot(viewport)))  # what the eye sees first
    if viewport != "phone":
        assert page.evaluate("window.scrollY") == 0
        button = page.locator("#decision-form button[type=submit]").bounding_box()
        report = page.locator("#report-panel").bounding_box()
        assert button["y"] + button["height"] <= size["height"], (button, size)
        assert page.locator("#decision-form").bounding_box()["x"] > report["x"]  # beside it
        expect(page.locator("#rebuild-report")).to_be_visible()  # in review: it can help
    check = Checks(width)
    check(page, f"request-ready-{viewport}")
    check.assert_clean()


def _viewport_shot(viewport: str):
    from tests.e2e.test_browser import SCREENSHOTS

    return SCREENSHOTS / f"offices-request-ready-{viewport}-viewport.png"
