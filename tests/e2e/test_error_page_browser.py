"""The server-error page in the real browser (issue 43): the time and reference a reader
passes on, at 1366 and 390 px, with no axe-core violation that blocks and no sideways
scrolling on a phone. Screenshots in ``var/screenshots/``."""

from __future__ import annotations

import re

import pytest

from tests.e2e import a11y
from tests.e2e.test_browser import browser, shot  # noqa: F401 (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.mark.urls("tests.permits.urls_boom")
def test_error_page__shows_time_and_reference_passes_axe_and_fits_a_phone(
    live_server,
    browser,  # noqa: F811 (the fixture imported above)
):
    failures = []
    for width, viewport in a11y.VIEWPORTS.items():
        context = browser.new_context(viewport=viewport)
        page = context.new_page()
        page.set_default_timeout(20_000)
        assert page.goto(f"{live_server.url}/boom/").status == 500
        shot(page, f"a11y-{width}-server-error")
        text = page.locator(".error-reference").inner_text()
        assert re.search(r"reference [0-9a-f]{8}", text), text
        assert "private-value" not in page.content()
        found = a11y.blocking(a11y.violations(page))
        if found:
            failures.append(f"{width}: {a11y.describe(found)}")
        if width == "phone" and a11y.scroll_width(page) > viewport["width"]:
            failures.append(f"{width}: {a11y.scroll_width(page)} px wide")
        context.close()
    assert not failures, "\n".join(failures)
