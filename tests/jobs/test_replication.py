"""Zero loss where the deployment asks for it (issue 47, part 2).

``JOBS_REQUIRE_SYNC_REPLICATION`` makes ``jobs.W020`` warn when the jobs' database reports
no synchronous standby; the local PostgreSQL has none. The failover connection settings
of docs/deployment.md (libpq multi-host, ``target_session_attrs=read-write``) connect
past a host that does not answer.
"""

from __future__ import annotations

import dj_database_url
import pytest
from django.db import connection
from django.db.backends.postgresql.base import DatabaseWrapper
from django.test import override_settings

from jobs import checks
from jobs.checks import Replication

pytestmark = pytest.mark.django_db


def _standby_names() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_standby_names")
        return cursor.fetchone()[0]


@pytest.mark.postgres
def test_sync_replication_check__warns_when_required_and_no_standby_is_synchronous():
    assert _standby_names() == "", "the local server has no standby"
    with override_settings(JOBS_REQUIRE_SYNC_REPLICATION=True):
        [warning] = checks.check_sync_replication(databases=["default"])
    assert warning.id == "jobs.W020"
    assert "synchronous_standby_names is empty" in warning.msg
    assert "synchronous_standby_names" in warning.hint and "deployment.md" in warning.hint


@pytest.mark.postgres
def test_sync_replication_check__silent_when_not_required():
    with override_settings(JOBS_REQUIRE_SYNC_REPLICATION=False):
        assert checks.check_sync_replication(databases=["default"]) == []
    # Only with the database checks (migrate, check --database default).
    with override_settings(JOBS_REQUIRE_SYNC_REPLICATION=True):
        assert checks.check_sync_replication(databases=None) == []


def test_sync_replication_check__sqlite_has_no_standby():
    if connection.vendor == "postgresql":
        pytest.skip("the SQLite leg's check")
    with override_settings(JOBS_REQUIRE_SYNC_REPLICATION=True):
        [warning] = checks.check_sync_replication(databases=["default"])
    assert warning.id == "jobs.W020" and "sqlite" in warning.msg


@pytest.mark.parametrize(
    ("replication", "problem"),
    [
        (Replication("FIRST 1 (standby1)", "on", False, 1), None),
        (Replication("ANY 1 (s1, s2)", "remote_apply", False, 1), None),
        (Replication("FIRST 1 (standby1)", "on", False, None), None),  # hidden from the role
        (Replication("", "on", False, 0), "synchronous_standby_names is empty"),
        (Replication("standby1", "local", False, 1), "synchronous_commit is 'local'"),
        (Replication("standby1", "off", False, 1), "synchronous_commit is 'off'"),
        (Replication("standby1", "on", False, 0), "no standby is connected as sync"),
        (Replication("standby1", "on", True, 1), "reaches a standby"),
    ],
)
def test_replication__problem(replication, problem):
    found = replication.problem()
    assert found is None if problem is None else problem in found


def _ask(settings_dict: dict) -> tuple:
    """Connect with ``settings_dict`` alone; the server's port and whether it is a standby."""
    wrapper = DatabaseWrapper(settings_dict, alias="failover")
    try:
        with wrapper.cursor() as cursor:
            cursor.execute("SELECT inet_server_port(), pg_is_in_recovery()")
            return cursor.fetchone()
    finally:
        wrapper.close()


@pytest.mark.postgres
def test_multi_host_settings__connect_past_a_host_that_does_not_answer():
    """docs/deployment.md's DATABASES: two hosts, the first refuses (port 1); libpq tries
    the next and keeps the one that accepts writes."""
    port = int(connection.settings_dict.get("PORT") or 5432)
    multi = {
        **connection.settings_dict,
        "HOST": "127.0.0.1,127.0.0.1",
        "PORT": f"1,{port}",
        "OPTIONS": {
            **connection.settings_dict.get("OPTIONS", {}),
            "target_session_attrs": "read-write",
            "connect_timeout": 3,
        },
    }
    assert _ask(multi) == (port, False)


@pytest.mark.postgres
def test_multi_host_url__parses_into_the_same_settings():
    """The site's DATABASE_URL form (one port for every host)."""
    name = connection.settings_dict["NAME"]
    parsed = dj_database_url.parse(
        f"postgres://root@127.0.0.1,localhost/{name}?target_session_attrs=read-write"
    )
    assert parsed["HOST"] == "127.0.0.1,localhost"
    assert parsed["OPTIONS"] == {"target_session_attrs": "read-write"}
    settings_dict = {**connection.settings_dict, **parsed, "PORT": connection.settings_dict["PORT"]}
    assert _ask(settings_dict)[1] is False
