"""A server error can be found (issue 43 part 4): the console action that raised is
logged by ``django.request`` with its traceback and a reference, and the 500 page shows
that reference and the time, so an operator told them finds the line."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from django.test import Client

from jobs import flow
from permits.logs import PlainFormatter

pytestmark = pytest.mark.django_db

PRIVATE = "applicant phone +1 555 0199"


def _raise(*args, **kwargs):
    raise RuntimeError(f"forced by the test: {PRIVATE}")


@pytest.mark.parametrize("debug", [False, True], ids=["production", "demo"])
def test_server_error__a_console_action_that_raises_is_logged_and_the_page_names_it(
    admin_user, settings, caplog, monkeypatch, debug
):
    settings.DEBUG = debug
    monkeypatch.setattr(flow, "pause", _raise)
    client = Client(raise_request_exception=False)
    client.force_login(admin_user)

    answer = client.post(
        "/admin/jobs/flowrule/toggle/",
        {"scope": "provider:webhook", "action": "pause", "confirmed": "yes"},
    )

    assert answer.status_code == 500
    (record,) = [r for r in caplog.records if r.name == "django.request" and r.exc_info]
    ref = record.error_reference
    assert re.fullmatch(r"[0-9a-f]{8}", ref)
    line = PlainFormatter("%(asctime)s %(levelname)s %(name)s %(message)s").format(record)
    assert f"Internal Server Error: /admin/jobs/flowrule/toggle/ ref={ref}" in line
    assert "Traceback (most recent call last)" in line and "admin_flow.py" in line
    assert "builtins.RuntimeError (message redacted)" in line and PRIVATE not in line

    page = answer.content.decode()
    assert "Sorry, something went wrong" in page
    assert f"reference <strong><code>{ref}</code></strong>" in page
    shown = re.search(r"Happened at <strong><time datetime=\"([^\"]+)\">", page)
    assert shown, page
    at = datetime.fromisoformat(shown.group(1))
    logged = datetime.fromtimestamp(record.created, UTC)
    assert abs((at - logged).total_seconds()) < 5, "the page's time is the log line's"
    for technical in (PRIVATE, "RuntimeError", "Traceback"):
        assert technical not in page


def test_server_error__each_error_gets_its_own_reference(admin_user, caplog, monkeypatch):
    monkeypatch.setattr(flow, "pause", _raise)
    client = Client(raise_request_exception=False)
    client.force_login(admin_user)
    data = {"scope": "provider:webhook", "action": "pause", "confirmed": "yes"}
    pages = [client.post("/admin/jobs/flowrule/toggle/", data) for _ in range(2)]
    refs = [r.error_reference for r in caplog.records if r.name == "django.request"]
    assert len(set(refs)) == 2
    for ref, page in zip(refs, pages, strict=True):
        assert ref in page.content.decode()
