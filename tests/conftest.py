"""Shared fixtures. PostgreSQL-only tests skip visibly on SQLite, and fail in CI instead."""

from __future__ import annotations

import os
import shutil

import pytest
from django.conf import settings
from django.db import connection


def _database_leg() -> str:
    """Which database this run tests: "PostgreSQL" or "SQLite" (the leg's name)."""
    vendor = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
    return {"postgresql": "PostgreSQL", "sqlite3": "SQLite"}.get(vendor, vendor)


def pytest_report_header(config):
    return f"database leg: {_database_leg()}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # Just above pytest's own closing line, so a log of `make test` says which leg it closes.
    if getattr(config, "workerinput", None) is None:
        terminalreporter.write_sep("-", f"{_database_leg()} leg")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(pytest.mark.postgres)
    # The long tests first (the wheel's, then the other e2e and slow ones): pytest-xdist
    # hands tests out in this order (make test: --maxschedchunk 1, so no worker queues
    # more than two), and the ones that wait on real processes for a minute start at
    # once instead of ending the run alone.
    items.sort(key=lambda item: 0 if "wheel" in item.keywords else 1 + (not _long(item)))


def _long(item) -> bool:
    return bool({"e2e", "slow"} & set(item.keywords))


@pytest.fixture(autouse=True)
def _require_postgres(request):
    if request.node.get_closest_marker("postgres") is None:
        return
    if connection.vendor != "postgresql":
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run PostgreSQL tests: set DATABASE_URL to a postgres:// URL")
        pytest.skip("needs PostgreSQL: set DATABASE_URL=postgres://... (never skipped in CI)")


@pytest.fixture(autouse=True)
def _clean_artifacts():
    root = settings.STORAGES["artifacts"]["OPTIONS"]["location"]
    shutil.rmtree(root, ignore_errors=True)
    yield


@pytest.fixture
def make_user(db, django_user_model):
    counter = iter(range(1, 10_000))

    def make(**fields):
        fields.setdefault("username", f"user{next(counter)}")
        return django_user_model.objects.create_user(**fields)

    return make
