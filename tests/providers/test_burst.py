"""``manage.py burst``: the drill end to end, and the verdict it draws from the record."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection

from jobs.contrib.drills import burst
from jobs.testing.fakeprovider import Record, _Writer
from tests.providers.conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[2]


def _manage(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.drill
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_burst__83_jobs_outage_then_recovery_passes(tmp_path):
    """The full drill: 83 jobs, provider down then back, bound 4, 6 worker processes."""
    if connection.vendor == "postgresql":
        env = subprocess_env()  # the test database pytest-django created
    else:
        # The in-memory test database is invisible to other processes: a fresh file.
        env = subprocess_env(VAR_DIR=str(tmp_path / "var"))
        env.pop("DATABASE_URL", None)
        migrated = _manage("migrate", "--noinput", "-v0", env=env, timeout=120)
        assert migrated.returncode == 0, migrated.stderr
    # 200 s was too short once on a loaded CI machine (the drill takes about a minute alone).
    proc = _manage("burst", "--jobs", "83", "--json", env=env, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["passed"] and report["problems"] == []
    assert report["notices_expected"] == report["notices_applied"] == 83
    assert report["ledger_applied"] == 83 and report["jobs_succeeded"] == 83
    assert report["missing"] == [] and report["applied_twice"] == {}
    assert 1 <= report["max_in_flight"] <= report["config"]["max_in_flight"] == 4
    # Every notice met the outage first: a refused send, or held at the open circuit.
    assert report["refused_while_down"] >= 1 and report["held_by_circuit"] >= 1
    assert report["refused_while_down"] + report["held_by_circuit"] >= 83
    assert report["provider_requests"] == {"201 applied": 83}


def _record(tmp_path, calls) -> Record:
    """A provider record with the given (start, end, key, effect_id, applied) calls."""
    path = tmp_path / "crafted.sqlite3"
    writer = _Writer(path)
    for n, (start, end, key, effect_id, applied) in enumerate(calls):
        send_id = ""
        if applied:
            body = {"effect_id": effect_id, "recipient": "1", "n": n}
            _, _, send_id = writer.apply(key, body, f"sha-{n}")
        writer.request(
            method="POST",
            path="/notices",
            received_at=start,
            answered_at=end,
            idempotency_key=key,
            effect_id=effect_id,
            status=201 if applied else 503,
            outcome="applied" if applied else "unavailable",
            send_id=send_id,
        )
    writer.close()
    return Record(path)


def test_burst_analyse__passes_a_clean_run(tmp_path):
    record = _record(tmp_path, [(0.0, 1.0, "k1", "e1", True), (1.0, 2.0, "k2", "e2", True)])
    expected = {"e1": ("applied", "ntc_1"), "e2": ("applied", "ntc_2")}
    report = burst.analyse(record, expected, bound=1, up_at=0.0, report=burst.BurstReport("r", {}))
    assert report.passed, report.problems
    assert report.max_in_flight == 1, "back-to-back calls do not overlap"
    assert report.calls_per_second == [(0, 1), (1, 1)]


def test_burst_analyse__flags_exceeded_bound_missing_and_twice_applied(tmp_path):
    record = _record(
        tmp_path,
        [
            (0.0, 2.0, "k1", "e1", True),
            (0.5, 1.5, "k1b", "e1", True),  # e1 again under a new key, overlapping
            (1.0, 1.2, "k3", "e3", False),  # a third call in flight, never applied
        ],
    )
    expected = {"e1": ("applied", "ntc_1"), "e3": ("pending", "")}
    report = burst.analyse(record, expected, bound=2, up_at=None, report=burst.BurstReport("r", {}))
    assert not report.passed
    assert report.max_in_flight == 3
    assert report.missing == ["e3"] and report.applied_twice == {"e1": 2}
    text = " | ".join(report.problems)
    assert "bound exceeded: 3" in text and "missing" in text and "more than once" in text


@pytest.mark.django_db
def test_burst_command__exits_non_zero_when_the_drill_fails(monkeypatch):
    failing = burst.BurstReport(
        "r",
        burst.BurstConfig().__dict__,
        problems=["bound exceeded: 5 calls in flight at once (bound 4)"],
    )
    monkeypatch.setattr(burst, "run", lambda config, out=None: failing)
    out = StringIO()
    with pytest.raises(SystemExit) as exit_:
        call_command("burst", "--jobs", "3", stdout=out)
    assert exit_.value.code == 1
    assert "FAIL: bound exceeded" in out.getvalue()
