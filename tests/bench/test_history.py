"""``python -m bench --sections history`` at tiny sizes: it runs end to end on PostgreSQL and
prints the one line outside checks read (issue 46). Figures are not judged here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.testing import scratchdb

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"^history 2k/0: throughput \d+\.\d\d claim-p99 \d+\.\d\d publish-p99 \d+\.\d\d "
    r"retention-s \d+\.\d$",
    re.M,
)


@pytest.mark.postgres
@pytest.mark.slow
def test_history_section__prints_the_line_at_tiny_sizes(tmp_path):
    # Databases of this test's own (xdist workers and other checkouts run beside it).
    tag = f"t{os.getpid()}"
    names = {
        "BENCH_DB": f"bench_e2e_{tag}",
        "BENCH_HISTORY_DB": f"bench_history_{tag}",
        "BENCH_LEDGER_DB": f"bench_ledger_{tag}",
    }
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(names)
    try:
        proc = subprocess.run(
            [
                sys.executable, "-m", "bench", "--sections", "history",
                "--history-sizes", "0,2k", "--history-jobs", "30", "--rounds", "1",
                "--history-before", "1", "--json", str(tmp_path / "results.json"),
            ],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        url = scratchdb.server_url()
        history = names["BENCH_HISTORY_DB"]
        for name in (names["BENCH_DB"], history, f"{history}_0"):
            scratchdb.drop(url, name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert LINE.search(proc.stdout), proc.stdout[-3000:]
    assert re.search(r"^history bar \(issue 46, at 2k\): throughput ", proc.stdout, re.M)
    # Both sizes' detail lines, the retention pass's included.
    assert re.search(r"history 2k retention: 200 jobs \(\d+ effects\) archived", proc.stdout)
    with scratchdb.admin_connection(url) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", [f"bench_history_{tag}%"]
        ).fetchall()
    assert left == []  # the section drops its databases
