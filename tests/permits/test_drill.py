"""`manage.py drill` passes on SQLite and on PostgreSQL, in a scratch database it cleans up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parents[2]


def run_drill(database_url: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.pop("DATABASE_URL", None)
    if database_url:
        env["DATABASE_URL"] = database_url
    return subprocess.run(
        [sys.executable, "manage.py", "drill"], cwd=ROOT, env=env, capture_output=True, text=True
    )


def assert_passed(proc: subprocess.CompletedProcess, vendor: str) -> None:
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert f"Practice drill on {vendor}" in out
    for step in ("reclaim, verify, publish", "publish CAS lost", "same key", "malformed payload"):
        assert step in out
    assert "render skipped (done by attempt 1)" in out  # the two-step report's second attempt
    assert "[ok] each step's fn ran once in all" in out
    # The stalled send's re-drive asks the provider by key instead of sending again.
    assert "looked up by key: applied, 1 POST in all" in out
    assert "provider_timeout" in out and "safe to retry" in out and "operator review" in out
    assert "[FAIL]" not in out


@pytest.mark.drill
@pytest.mark.slow
def test_drill__passes_on_sqlite():
    assert_passed(run_drill(None), "sqlite")


@pytest.mark.drill
@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.django_db
def test_drill__passes_on_postgresql_with_a_real_deadlock():
    db = connection.settings_dict
    host = f"{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}"
    url = f"postgres://{db['USER'] or 'root'}@{host}/postgres"
    proc = run_drill(url)
    assert_passed(proc, "postgresql")
    assert "real deadlock, 40P01" in proc.stdout
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_database WHERE datname LIKE 'drill\\_%%'")
        assert cursor.fetchone()[0] == 0, "the scratch database is dropped"
