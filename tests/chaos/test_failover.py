"""The failover drill inside the suite (issue 47): ``make failover-drill``, marked drill.

It starts its own primary and standby (PostgreSQL's server binaries, ``PG_BIN``), so it
needs no ``DATABASE_URL``; a run here took a few minutes on the shared 2-core machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.chaos import pgcluster
from tests.chaos.failover import summary

ROOT = Path(__file__).resolve().parents[2]


def test_summary__one_line_with_every_field():
    results = {
        "sync": {
            "failures": [],
            "figures": {"lost": 0, "reused": 0, "duplicates": 0, "orphans": 0},
        },
        "async": {
            "failures": ["x"],
            "figures": {"reused": 0, "reconciled": "3/4", "second_sends": 0},
        },
    }
    assert summary(results) == (
        "failover-drill: FAIL sync lost=0 reused=0 duplicates=0 orphans=0; "
        "async reused=0 reconciled=3/4 second-sends=0"
    )
    results["async"]["failures"] = []
    assert summary(results).startswith("failover-drill: PASS ")
    assert summary({"sync": results["sync"]}).startswith("failover-drill: FAIL "), "a mode missing"


@pytest.mark.drill
@pytest.mark.skipif(not (pgcluster.BIN / "initdb").exists(), reason="no PostgreSQL binaries")
def test_failover_drill__passes_in_both_modes():
    done = subprocess.run(
        [sys.executable, "-m", "tests.chaos.failover", "--jobs", "36"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    last = done.stdout.rstrip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert last.startswith("failover-drill: PASS sync lost=0 reused=0 duplicates=0 orphans=0;")
    assert "second-sends=0" in last and "async reused=0" in last
