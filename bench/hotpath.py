"""Database cost and Python cost of one delivery, measured in this process.

``capture`` lists the statements of ``request_job``, one ``run_delivery`` of
the minimal kind and a duplicate delivery (Django logs BEGIN and COMMIT too),
classified as round trips and commits. ``split`` runs a batch of deliveries
and splits their wall time into time inside the database driver (statements,
commits) and the rest (Python: ORM, engine, logging, file I/O); ``profile``
runs another batch under cProfile and groups the time by where it is spent.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import re
import time
from collections import Counter
from dataclasses import dataclass, field

from django.db import connection
from django.test.utils import CaptureQueriesContext

import jobs
from bench import workloads
from jobs.delivery.runner import run_delivery

# A data-modifying WITH (the one-statement claim and publish, jobs/sql.py) is a write too.
WRITE = re.compile(r"^\s*(INSERT|UPDATE|DELETE)\b|^\s*WITH\b.*\b(INSERT|UPDATE)\b", re.I | re.S)


@dataclass
class Trace:
    """The statements one call sent, in order."""

    label: str
    sql: list[str]

    @property
    def round_trips(self) -> int:
        """Every entry is one exchange with the server (BEGIN and COMMIT included)."""
        return len(self.sql)

    def _walk(self):
        in_tx = False
        for sql in self.sql:
            head = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else ""
            if head.startswith("BEGIN"):
                in_tx = True
            elif head in ("COMMIT", "ROLLBACK"):
                in_tx = False
            yield head, in_tx, sql

    @property
    def commits(self) -> int:
        """Commits: explicit COMMITs plus writes sent in autocommit mode (each its own)."""
        n = 0
        for head, in_tx, sql in self._walk():
            if head == "COMMIT" or (not in_tx and WRITE.match(sql)):
                n += 1
        return n

    @property
    def transactions(self) -> int:
        return sum(1 for head, _, _ in self._walk() if head.startswith("BEGIN"))

    @property
    def statements(self) -> int:
        skip = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE")
        return sum(1 for head, _, _ in self._walk() if not head.startswith(skip))

    def summary(self) -> str:
        return (
            f"{self.round_trips} round trips ({self.statements} statements, "
            f"{self.transactions} transactions), {self.commits} commits"
        )

    def listing(self) -> list[str]:
        """One short line per statement: what it is, not its values."""
        out = []
        for head, in_tx, sql in self._walk():
            out.append(("  " if in_tx and head not in ("COMMIT",) else "") + _short(sql))
        return out


def _short(sql: str) -> str:
    s = " ".join(sql.split())
    m = re.match(r"(SELECT .*?) FROM (\"?\w+\"?)(.*)", s)
    if s.upper().startswith("SELECT") and m:
        where = re.search(r"WHERE (.*?)( ORDER BY| LIMIT|$)", m.group(3))
        cond = re.sub(r"'[^']*'|\b\d+\b", "?", where.group(1)) if where else ""
        cols = "1" if "SELECT 1" in s else ("COUNT(*)" if "COUNT(" in s else "*")
        table = m.group(2).replace('"', "")
        return f"SELECT {cols} FROM {table}" + (f" WHERE {cond[:90]}" if cond else "")
    m = re.match(r"(INSERT INTO|UPDATE|DELETE FROM) \"?(\w+)\"?", s)
    if m:
        if m.group(1) == "UPDATE":
            sets = re.findall(r"\"(\w+)\" = ", s.split(" WHERE ")[0])
            where = re.findall(r"\"\w+\"\.\"(\w+)\" = ", s.split(" WHERE ")[-1])
            return f"UPDATE {m.group(2)} SET {','.join(sets[:6])} WHERE {','.join(where)}"
        return f"{m.group(1)} {m.group(2)}"
    return re.sub(r"'[^']*'|-?\b\d+\b", "?", s)[:100]


def capture(user_id: int) -> dict[str, Trace]:
    """The three hot-path traces of the minimal kind (the same paths the test pins)."""
    traces = {}
    with CaptureQueriesContext(connection) as c:
        job = jobs.request(
            workloads.SUMMARY,
            ("bench.item", f"trace-{os.getpid()}-{time.monotonic_ns()}"),
            tenant="bench",
            params={"notify_user_id": user_id},
        ).job
    traces["request_job"] = Trace("request_job (create + enqueue)", [q["sql"] for q in c])
    with CaptureQueriesContext(connection) as c:
        result = run_delivery(job.pk)
    assert result.outcome == "succeeded", result
    traces["run_delivery"] = Trace("run_delivery (minimal kind)", [q["sql"] for q in c])
    with CaptureQueriesContext(connection) as c:
        result = run_delivery(job.pk)
    assert result.outcome == "duplicate", result
    traces["duplicate"] = Trace("duplicate delivery", [q["sql"] for q in c])
    return traces


def capture_report() -> tuple[Trace, float]:
    """One permit report delivery (PDF, reviewers, guardian checks): its trace, and the
    median milliseconds of a dozen more (one per seeded permit) to size the runs."""
    ids = workloads.enqueue_reports(13, first_revision=workloads.MAX_REVISION - 1)
    with CaptureQueriesContext(connection) as c:
        result = run_delivery(ids[0])
    assert result.outcome == "succeeded", result
    samples = []
    for pk in ids[1:]:
        t = time.perf_counter()
        run_delivery(pk)
        samples.append((time.perf_counter() - t) * 1000)
    samples.sort()
    return Trace("run_delivery (permits.report)", [q["sql"] for q in c]), samples[len(samples) // 2]


@dataclass
class Split:
    """Per delivery, in milliseconds."""

    jobs: int
    wall_ms: float
    db_ms: float  # inside the driver: statements (BEGIN included) and COMMITs
    statements: float
    commits: float
    per_statement: Counter = field(default_factory=Counter)  # ms per job, by statement kind

    @property
    def python_ms(self) -> float:
        return self.wall_ms - self.db_ms


def split(user_id: int, n: int = 200) -> Split:
    """Time ``n`` deliveries back to back; the driver's share is timed around each call."""
    ids = workloads.enqueue_summaries(n, user_id)
    db = {"t": 0.0, "statements": 0, "commits": 0}
    by_kind: Counter = Counter()

    def timed_execute(execute, sql, params, many, context):
        t = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            dt = time.perf_counter() - t
            db["t"] += dt
            db["statements"] += 1
            by_kind[_short(sql).split(" WHERE ")[0]] += dt

    wrapper = connection  # the default alias in this thread
    wrapper.ensure_connection()
    original_commit = wrapper._commit

    def timed_commit():
        t = time.perf_counter()
        try:
            return original_commit()
        finally:
            dt = time.perf_counter() - t
            db["t"] += dt
            db["commits"] += 1
            by_kind["COMMIT"] += dt

    wrapper._commit = timed_commit
    try:
        with connection.execute_wrapper(timed_execute):
            t0 = time.perf_counter()
            for pk in ids:
                run_delivery(pk)
            wall = time.perf_counter() - t0
    finally:
        del wrapper._commit
    per_kind = Counter({k: v * 1000 / n for k, v in by_kind.items()})
    return Split(
        n, wall * 1000 / n, db["t"] * 1000 / n, db["statements"] / n, db["commits"] / n, per_kind
    )


BUCKETS = [
    ("driver: psycopg execute + commit", ("psycopg/", "psycopg_binary/", "psycopg_c/")),
    ("Django ORM: compile SQL, build rows", ("django/db/models/", "django/db/backends/")),
    ("Django transaction/connection", ("django/db/transaction", "django/db/utils")),
    ("logging", ("logging/", "jobs/logformat")),
    ("artifact file I/O (write, fsync, link)", ("posix.fsync", "posix.link", "tempfile")),
]


def profile(user_id: int, n: int = 150, top: int = 18) -> tuple[list[tuple], list[str]]:
    """cProfile ``n`` deliveries; return time by bucket (ms per job) and the top functions."""
    ids = workloads.enqueue_summaries(n, user_id)
    prof = cProfile.Profile()
    prof.enable()
    for pk in ids:
        run_delivery(pk)
    prof.disable()
    stats = pstats.Stats(prof)
    total = sum(tt for (_, _, tt, _, _) in stats.stats.values())
    buckets = Counter()
    for (filename, _line, func), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
        where = f"{filename}:{func}"
        if filename == "~":
            where = func  # built-ins: "<built-in method posix.fsync>"
        for label, needles in BUCKETS:
            if any(n in where for n in needles):
                buckets[label] += tt
                break
        else:
            buckets["other Python (engine, kinds, stdlib)"] += tt
    rows = [(label, secs * 1000 / n) for label, secs in buckets.most_common()]
    rows.append(("total (under the profiler)", total * 1000 / n))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return rows, lines[start : start + top + 1]
