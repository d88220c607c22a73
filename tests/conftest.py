"""Shared fixtures. PostgreSQL-only tests skip visibly on SQLite, and fail in CI instead."""

from __future__ import annotations

import os
import shutil

import pytest
from django.conf import settings
from django.db import connection


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(pytest.mark.postgres)


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
