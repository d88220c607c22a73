"""Input checked once at the edge (issue 44): a flow scope longer than its column (200
characters) gets the same clear refusal from the console, the admin and ``jobs_limits``
(no 500, no ``DataError``, no traceback); a server error is logged with its traceback
and without its message."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from django.conf import settings as django_settings
from django.core.management import CommandError, call_command

from jobs import flow
from jobs.models import FlowRule, FlowRuleChange
from permits.logs import PlainFormatter

pytestmark = pytest.mark.django_db

LONG = "kind:" + "x" * 196  # 201 characters: one more than FlowRule.scope holds
REFUSAL = "scope is at most 200 characters, this one has 201"


@pytest.fixture(autouse=True)
def _fresh_rules():
    flow.forget()
    yield
    flow.forget()


def nothing_written() -> bool:
    return not FlowRule.objects.exists() and not FlowRuleChange.objects.exists()


def test_check_scope__knows_the_column_limit():
    assert len(LONG) == 201 and flow.scope_max_length() == 200
    assert flow.check_scope(LONG[:200]) == LONG[:200], "200 characters are fine"
    with pytest.raises(flow.FlowError, match=REFUSAL):
        flow.check_scope(LONG)
    with pytest.raises(flow.FlowError, match=REFUSAL):
        flow.set_rule(LONG, actor="test", paused=True)
    with pytest.raises(flow.FlowError, match="a note is at most 120 characters"):
        flow.set_rule("kind:x", actor="test", paused=True, note="n" * 121)
    assert nothing_written()


@pytest.mark.parametrize("confirmed", ["", "yes"])
def test_console_pause__201_characters_refused_in_words(admin_client, confirmed):
    answer = admin_client.post(
        "/admin/jobs/flowrule/toggle/",
        {"scope": LONG, "action": "pause", "confirmed": confirmed},
        follow=True,
    )
    assert answer.status_code == 200
    page = answer.content.decode()
    assert REFUSAL in page and "Traceback" not in page and "DataError" not in page
    assert nothing_written()


def test_admin_add__201_characters_refused_on_the_form(admin_client):
    answer = admin_client.post(
        "/admin/jobs/flowrule/add/", {"scope": LONG, "period_seconds": "1", "paused": "on"}
    )
    assert answer.status_code == 200, "the form again, with the error"
    assert REFUSAL in answer.content.decode()
    assert answer.context["adminform"].form.errors["scope"] == [
        f"a {REFUSAL} (it starts {LONG[:40]!r})"
    ]
    assert nothing_written()


@pytest.mark.parametrize("action", ["pause", "resume", "delete"])
def test_jobs_limits__201_characters_refused_as_a_command_error(action):
    with pytest.raises(CommandError, match=REFUSAL):
        call_command("jobs_limits", action, LONG)
    with pytest.raises(CommandError, match=REFUSAL):
        call_command("jobs_limits", "set", LONG, "--concurrency", "2")
    assert nothing_written()


@pytest.mark.skipif(
    "sqlite" in django_settings.DATABASES["default"]["ENGINE"], reason="same check either way"
)
def test_jobs_limits__the_shell_sees_one_line_and_no_traceback():
    done = subprocess.run(
        [sys.executable, "manage.py", "jobs_limits", "pause", LONG],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
    )
    assert done.returncode == 1
    assert REFUSAL in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_logging__django_request_errors_reach_the_console_handler():
    loggers = django_settings.LOGGING["loggers"]
    assert loggers["django.request"]["level"] == "ERROR"
    assert loggers["django"]["handlers"] == ["console"]


def test_logging__a_traceback_without_its_message():
    try:
        try:
            raise KeyError("applicant phone +1 555 0199")
        except KeyError as exc:
            raise RuntimeError("private-value 1234") from exc
    except RuntimeError:
        record = logging.LogRecord(
            "django.request",
            logging.ERROR,
            __file__,
            1,
            "Internal Server Error: %s",
            ("/boom/",),
            sys.exc_info(),
        )
    line = PlainFormatter("%(levelname)s %(name)s %(message)s").format(record)
    assert line.startswith("ERROR django.request Internal Server Error: /boom/")
    assert "Traceback (most recent call last)" in line and "test_input_edge.py" in line
    assert "builtins.RuntimeError (message redacted)" in line
    assert "builtins.KeyError (message redacted)" in line
    assert "555" not in line and "private-value" not in line
