"""Failures people can read: class, message and traceback kept for operators, not in logs."""

from __future__ import annotations

import html
import logging
import sys

import pytest
from django.contrib.auth.models import Group, Permission
from django.urls import reverse

from jobs import failures, registry
from jobs.api import JobHandle
from jobs.delivery.runner import run_delivery
from jobs.models import Attempt, Job
from tests.jobs.helpers import make_due, new_job

pytestmark = pytest.mark.django_db

SECRET = "applicant-jane@example.org"


def pool_handler(ctx):
    raise KeyError("pool")  # the line the traceback must name


POOL_LINE = pool_handler.__code__.co_firstlineno + 1


def secret_handler(ctx):
    raise ValueError(f"no permit for {SECRET}")


def exiting_handler(ctx):
    sys.exit(1)


registry.register_kind("test.lookup", pool_handler, max_attempts=2)
registry.register_kind("test.secret", secret_handler, max_attempts=1, redact_errors=True)
registry.register_kind(
    "test.secret_when",
    secret_handler,
    max_attempts=1,
    redact_errors=lambda exc: isinstance(exc, ValueError),
)
registry.register_kind("test.exits", exiting_handler, max_attempts=3)


def _run_to_the_end(job: Job) -> Job:
    for _ in range(job.max_attempts):
        run_delivery(job.pk, worker="w1")
        job.refresh_from_db()
        if job.is_terminal:
            break
        make_due(job)
    return job


def _operator(make_user, *, detail=True):
    user = make_user(is_staff=True)
    group, _ = Group.objects.get_or_create(name="operators")
    user.groups.add(group)
    user.user_permissions.add(*Permission.objects.filter(content_type__app_label="jobs"))
    if not detail:
        user.user_permissions.remove(Permission.objects.get(codename="view_error_detail"))
        group.permissions.remove(Permission.objects.get(codename="view_error_detail"))
    return user


def test_failure__keyerror_is_kept_for_operators_and_logged_without_its_message(
    client, make_user, caplog
):
    job = new_job(kind="test.lookup")
    with caplog.at_level(logging.INFO):
        job = _run_to_the_end(job)

    assert (job.state, job.attempts) == ("dead", 2)
    assert (job.last_error_type, job.last_error_message) == ("builtins.KeyError", "'pool'")
    assert f'line {POOL_LINE}, in pool_handler\n    raise KeyError("pool")' in (
        job.last_error_traceback
    )
    tried = Attempt.objects.filter(job=job, number__gt=0).order_by("number")
    assert [(a.outcome, a.error_type, a.error_message) for a in tried] == [
        ("retry", "builtins.KeyError", "'pool'"),
        ("dead", "builtins.KeyError", "'pool'"),
    ]

    # The worker log: one line per failed attempt, class and frames, never the message.
    lines = [r.getMessage() for r in caplog.records if r.name == "jobs.runner"]
    assert len(lines) == 2
    for number, line in enumerate(lines, 1):
        assert f"job={job.pk} kind=test.lookup attempt={number}" in line
        assert "error=builtins.KeyError" in line
        assert f"test_failures.py:{POOL_LINE}:pool_handler" in line
    assert not any("pool'" in r.getMessage() for r in caplog.records)

    # The job page: the operator reads the class, the message and the handler's line.
    client.force_login(_operator(make_user))
    page = html.unescape(client.get(reverse("admin:jobs_job_change", args=[job.pk])).text)
    assert "KeyError: 'pool'" in page
    assert f"line {POOL_LINE}, in pool_handler" in page
    assert page.count("KeyError: 'pool'") >= 3  # the job's last error and each attempt's

    # A developer following the job reads the same.
    failure = JobHandle(job).error
    assert (failure.error_class, failure.exception) == (job.last_error_class, "KeyError: 'pool'")
    assert f"line {POOL_LINE}, in pool_handler" in failure.traceback

    # The jobs list finds it by its message, and by its class.
    for term in ("pool", "KeyError"):
        listed = client.get(reverse("admin:jobs_job_changelist"), {"q": term})
        assert listed.context["cl"].result_count == 1, term
        assert listed.context["cl"].result_list[0].pk == job.pk


def test_failure__detail_needs_its_own_permission(client, make_user):
    job = _run_to_the_end(new_job(kind="test.lookup"))
    client.force_login(_operator(make_user, detail=False))
    page = html.unescape(client.get(reverse("admin:jobs_job_change", args=[job.pk])).text)
    assert "KeyError" in page  # the class is no secret: the list and filters show it
    assert "'pool'" not in page and "pool_handler" not in page
    listed = client.get(reverse("admin:jobs_job_changelist"), {"q": "pool"})
    assert listed.context["cl"].result_count == 0


def test_failure__console_lists_the_dead_job_with_its_message_for_who_may_read_it(
    client, make_user
):
    job = _run_to_the_end(new_job(kind="test.lookup"))
    console = reverse("admin:jobs_job_dashboard")
    client.force_login(_operator(make_user))
    row = client.get(console).context["failures"][0]
    assert (row[0].pk, row[2], row[3]) == (job.pk, job.last_error_class, "KeyError: 'pool'")
    client.force_login(_operator(make_user, detail=False))
    page = html.unescape(client.get(console).text)
    assert f"/admin/jobs/job/{job.pk}/change/" in page
    assert "'pool'" not in page


def test_failure__the_operators_group_holds_view_error_detail():
    from permits.signals import create_groups

    create_groups()
    operators = Group.objects.get(name="operators")
    assert operators.permissions.filter(codename="view_error_detail").exists()


@pytest.mark.parametrize("kind", ["test.secret", "test.secret_when"])
def test_failure__a_redacting_kind_keeps_no_message_anywhere(kind, caplog):
    with caplog.at_level(logging.DEBUG):
        job = _run_to_the_end(new_job(kind=kind))
    assert job.state == "dead"
    assert job.last_error_type == "builtins.ValueError" and job.last_error_message == ""
    assert "secret_handler" in job.last_error_traceback  # frames stay
    assert "builtins.ValueError (message redacted)" in job.last_error_traceback
    for row in [*Job.objects.filter(pk=job.pk).values(), *Attempt.objects.values()]:
        assert SECRET not in repr(row)
    assert SECRET not in caplog.text
    assert JobHandle(job).error.exception == "ValueError"
    assert SECRET not in repr(JobHandle(job).error)


def test_failure__messages_and_tracebacks_are_bounded():
    try:
        raise RuntimeError("x" * 10_000)
    except RuntimeError as exc:
        detail = failures.capture(exc)
    assert len(detail.message) == failures.MESSAGE_LIMIT
    assert "x" * 2_001 not in detail.traceback  # the traceback's message is bounded too
    assert detail.traceback.startswith("Traceback (most recent call last):")

    def chained(depth):
        try:
            if depth:
                chained(depth - 1)
            raise ValueError("first")
        finally:
            raise LookupError(f"{depth:03} " + "y" * 1_000)

    try:
        chained(30)
    except LookupError as exc:
        detail = failures.capture(exc)
    assert len(detail.traceback) <= failures.TRACEBACK_LIMIT
    assert "characters cut" in detail.traceback
    assert detail.traceback.endswith("LookupError: 030 " + "y" * 1_000 + "\n")


def test_failure__a_handler_calling_sys_exit_fails_its_attempt_and_the_worker_goes_on():
    job = new_job(kind="test.exits")
    result = run_delivery(job.pk, worker="w1")  # no SystemExit escapes
    job.refresh_from_db()
    assert (result.outcome, job.state, job.attempts) == ("failed", "failed", 1)
    assert (job.last_error_type, job.last_error_code) == ("builtins.SystemExit", "SystemExit")
    assert "exiting_handler" in job.last_error_traceback
    assert new_job(kind="test.lookup", subject=2) and True  # this process still runs work


def test_failure__json_log_lines_carry_class_and_frames_not_the_message():
    import json as jsonlib

    from jobs.logformat import JsonFormatter

    try:
        pool_handler(None)
    except KeyError:
        record = logging.LogRecord(
            "jobs.runner", logging.ERROR, __file__, 1, "job=1 failed", None, sys.exc_info()
        )
    entry = jsonlib.loads(JsonFormatter().format(record))
    assert entry["exc_type"] == "KeyError"
    assert f"test_failures.py:{POOL_LINE}:pool_handler" in entry["exc_frames"]
    assert "pool'" not in jsonlib.dumps(entry)
