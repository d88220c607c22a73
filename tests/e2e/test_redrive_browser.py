"""The console's Redrive pages in the real browser (issue 43): the groups, the confirmation
naming the count, and the redrive's result, at 1366 and 390 px, each with no axe-core
violation that blocks and no sideways scrolling on a phone. An operator redrives one group
by the buttons; the ledger and the one audit record say what it did. Screenshots in
``var/screenshots/`` (``a11y-<width>-redrive-<page>.png``)."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry

from jobs.models import Effect
from tests.e2e import a11y
from tests.e2e.test_browser import browser, login, shot  # noqa: F401 (fixture)
from tests.jobs.ops.test_redrive import inapp_effects, operator, stuck

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.testapp.urls"),
]
PASSWORD = "redrive-operator"
GROUPS = "/admin/jobs/job/redrive/"


def _check(page, width: str, name: str, failures: list[str]) -> None:
    page.wait_for_load_state()
    shot(page, f"a11y-{width}-redrive-{name}")
    found = a11y.blocking(a11y.violations(page))
    if found:
        failures.append(f"{width}/{name}: {a11y.describe(found)}")
    viewport = a11y.VIEWPORTS[width]
    if width == "phone" and a11y.scroll_width(page) > viewport["width"]:
        failures.append(f"{width}/{name}: {a11y.scroll_width(page)} px wide")


def test_redrive_pages__groups_confirmation_and_result_pass_axe_at_1366_and_390(
    live_server,
    browser,  # noqa: F811 (the fixture imported above)
    make_user,
):
    from playwright.sync_api import expect

    effects = inapp_effects(make_user, 4)
    stuck(effects[:3])
    stuck(effects[3:], state=Effect.State.FAILED, error_class="validation")
    user = operator(make_user)
    user.set_password(PASSWORD)
    user.save()
    failures: list[str] = []
    for width, viewport in a11y.VIEWPORTS.items():
        context = browser.new_context(viewport=viewport)
        page = context.new_page()
        page.set_default_timeout(20_000)
        login(page, live_server.url, "/admin/login/", user.get_username(), PASSWORD)
        page.goto(live_server.url + GROUPS)
        rows = page.locator("table.jobs-redrive-groups tbody tr")
        expect(rows).to_have_count(2)
        expect(rows.first).to_contain_text("needs_review")
        expect(rows.first.locator("td").first).to_have_text("3")
        _check(page, width, "groups", failures)

        rows.first.get_by_role("link", name="Redrive…").click()
        expect(page.get_by_role("heading", name="Redrive 3 effects?")).to_be_visible()
        expect(page.locator("#content-main")).to_contain_text("has 3 rows")
        _check(page, width, "confirm", failures)
        if width == "desktop":
            page.get_by_role("link", name="No, take me back").click()
            expect(page).to_have_url(live_server.url + GROUPS)
        else:
            page.get_by_role("button", name="Yes, redrive 3").click()
            expect(page.locator(".messagelist")).to_contain_text("Redrive of effects")
            _check(page, width, "done", failures)
        context.close()

    redriven = Effect.objects.filter(pk__in=[e.pk for e in effects[:3]])
    assert not redriven.filter(state=Effect.State.NEEDS_REVIEW).exists()
    assert Effect.objects.get(pk=effects[3].pk).state == Effect.State.FAILED, "another group"
    assert LogEntry.objects.filter(user=user).count() == 1, "one audit record for one redrive"
    assert not failures, "\n".join(failures)
