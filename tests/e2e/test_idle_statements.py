"""An idle ``manage.py jobs_worker`` sends at most one statement a second, counted by the
server's own ``pg_stat_statements`` (issue 41).

The shared server does not load ``pg_stat_statements`` (it needs
``shared_preload_libraries`` and a restart), so the drill starts a server of its own on
loopback from the machine's binaries (``tests.chaos.pgcluster``: initdb, trust auth),
with the library preloaded, migrates the site into it and runs the quickstart's one
worker process, the supervisor and its cluster, with the site's production settings (its
dispatcher schedule included: the maintenance round runs inside ``jobs_worker``). After
the start-up settles the counters are reset, and every statement any session of the
site's database runs over a minute is counted (``calls``), the reading itself excluded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.chaos import pgcluster

pytestmark = [pytest.mark.drill, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 60.0  # the minute; holds one run of the site's once-a-minute schedule
SETTLE = 20.0  # the worker's start-up: each process's first connection, the first looks


@pytest.fixture
def counted_server(tmp_path):
    """A private PostgreSQL with ``pg_stat_statements`` loaded, and its site database."""
    if not (pgcluster.BIN / "initdb").exists():
        missing = f"no PostgreSQL server binaries in {pgcluster.BIN} (PG_BIN)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run this drill: {missing}")
        pytest.skip(f"{missing}; never skipped in CI")
    folder = pgcluster.workdir("idle-statements-")
    server = pgcluster.Server("counted", folder / "data", "127.0.0.1", pgcluster.free_port())
    pgcluster.initdb(server)
    server.start(
        "-c shared_preload_libraries=pg_stat_statements", "-c pg_stat_statements.track=all"
    )
    try:
        server.wait_ready(writable=True)
        server.query(f"CREATE DATABASE {pgcluster.DATABASE}", dbname="postgres")
        server.query("CREATE EXTENSION pg_stat_statements", dbname="postgres")
        yield server
    finally:
        pgcluster.remove(folder, [server])


def _site_env(server: pgcluster.Server, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEST_", "PYTEST_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="permits.settings",
        DATABASE_URL=(
            f"postgres://{pgcluster.ROLE}@{server.host}:{server.port}/{pgcluster.DATABASE}"
        ),
        SECRET_KEY="idle-statements-drill",
        ALLOWED_HOSTS="localhost",
        VAR_DIR=str(tmp_path / "var"),
        PYTHONUNBUFFERED="1",
    )
    return env


def _statements(server: pgcluster.Server) -> dict[str, int]:
    """Calls per statement text of the site's database so far (read from ``postgres``)."""
    rows = server.query(
        "SELECT s.query, s.calls FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
        " WHERE d.datname = %s",
        (pgcluster.DATABASE,),
        dbname="postgres",
    )
    return {query: calls for query, calls in rows}


def test_idle_jobs_worker__sends_at_most_one_statement_a_second(counted_server, tmp_path):
    env = _site_env(counted_server, tmp_path)
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput"], cwd=ROOT, env=env, check=True, timeout=300)
    log = (tmp_path / "jobs_worker.log").open("w")
    worker = subprocess.Popen(
        [*manage, "jobs_worker"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        time.sleep(SETTLE)
        assert worker.poll() is None, (tmp_path / "jobs_worker.log").read_text()[-3000:]
        counted_server.query("SELECT pg_stat_statements_reset()", dbname="postgres")
        time.sleep(WINDOW)
        calls = _statements(counted_server)
        assert worker.poll() is None, (tmp_path / "jobs_worker.log").read_text()[-3000:]
    finally:
        os.killpg(worker.pid, 15)
        worker.wait(timeout=60)
        log.close()
    total = sum(calls.values())
    rate = total / WINDOW
    print(f"\nIDLE_STATEMENTS: jobs_worker idle {WINDOW:.0f} s: {total} statements, {rate:.2f}/s")
    for query, n in sorted(calls.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {n:4d}  {' '.join(query.split())[:110]}")
    assert rate <= 1.0, calls
