"""The connection sizing check (jobs.W010) against the real server's max_connections."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection

from jobs.checks import check_connections

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]


def _server_limits() -> tuple[int, int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('max_connections')::int,"
            " current_setting('superuser_reserved_connections')::int"
            " + coalesce(current_setting('reserved_connections', true), '0')::int"
        )
        return cursor.fetchone()


def _configure(settings, *, missing: int) -> tuple[int, int, int, int]:
    """Settings whose processes need ``missing`` more connections than the server allows."""
    max_connections, reserved = _server_limits()
    allowed = max_connections - reserved
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "workers": 8}  # 8 + 3 + 1 per worker process
    processes = (allowed - 1) // 12
    web = allowed + missing - processes * 12 - 1
    settings.JOBS_EXPECTED_WORKER_PROCESSES = processes
    settings.JOBS_EXPECTED_DISPATCHERS = 1
    settings.JOBS_EXPECTED_WEB_CONNECTIONS = web
    return max_connections, reserved, processes, web


def test_check_connections__says_how_many_are_missing(settings):
    max_connections, reserved, processes, web = _configure(settings, missing=5)
    allowed = max_connections - reserved

    [warning] = check_connections(databases=["default"])

    assert warning.id == "jobs.W010"
    assert warning.msg == (
        f"PostgreSQL allows {allowed} connections (max_connections {max_connections} - "
        f"{reserved} reserved) but the configured processes may hold {allowed + 5} "
        f"({processes} worker process(es) x (8 django-q2 workers + 3 cluster processes + "
        f"1 supervisor) + 1 dispatcher(s) + {web} web): 5 missing"
    )
    assert "max_connections" in warning.hint


def test_check_connections__silent_when_the_server_allows_enough(settings):
    _configure(settings, missing=0)
    assert check_connections(databases=["default"]) == []


def test_check_connections__only_with_the_database_checks(settings):
    """Tagged ``database``: plain ``check`` skips it, ``check --database default`` runs it."""
    _configure(settings, missing=3)
    assert check_connections(databases=None) == []

    plain, with_database = StringIO(), StringIO()
    # Only what each prints is read: a kind another test registered in this process (its
    # own timeout, say) must not make the command fail here.
    lenient = ("--fail-level", "CRITICAL")
    call_command("check", *lenient, stdout=plain, stderr=plain)
    call_command(
        "check", "--database", "default", *lenient, stdout=with_database, stderr=with_database
    )
    assert "jobs.W010" not in plain.getvalue()
    assert "jobs.W010" in with_database.getvalue()
    assert ": 3 missing" in with_database.getvalue()
