"""The long-horizon drill: ``make horizon MINUTES=60`` (issue 46).

A steady stream of ``demo.summary`` jobs (each an artifact and an in-app notice) on two
worker hosts (``manage.py jobs_worker``) against a scratch database on a private
PostgreSQL with the server's defaults, autovacuum on (``--shared-server``: on
``DATABASE_URL``'s, whose autovacuum this machine turns off), with the archive on: once a
minute, as an operator's cron would, the drill runs the archive pass (``jobs.archive``)
over the jobs finished before the shortest window the checks allow
(``retention.minimum_days``: 400 s with these settings, ``tests.chaos.horizon_settings``).

Every minute it prints the working set's table and index bytes (jobs, attempts, effects,
their events, artifacts), its dead tuples (``pg_stat_user_tables``), the archive's records
and their bytes and the inbox's notices' bytes (both grow by design: an identity is kept
forever, compactly, and a notice as long as its recipient keeps it),
the jobs finished that minute and the p99 pickup (request to first start) of the jobs
started that minute.

The verdict compares thirds of the run (for 60 minutes: the first and the last 20): the
working set's bytes and dead tuples level off (the last third's growth at most 5 % of the
first third's, each read as its high-water mark: dead tuples fall at every vacuum),
throughput and p99 pickup stay within +-15 % of minute 5's. The last line is
``horizon: PASS ...`` or ``horizon: FAIL ...``; exit 1 on FAIL, 2 when it could not run.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import sys
import time
from pathlib import Path

from jobs.testing import scratchdb
from tests.chaos import pgcluster
from tests.chaos.drillhosts import scratch_project, start_hosts, tear_down

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_MODULE = "tests.chaos.horizon_settings"
WORKING_SET = (
    "jobs_job",
    "jobs_attempt",
    "jobs_effect",
    "jobs_effectevent",
    "jobs_jobevent",
    "jobs_artifact",
)
# What grows by design, printed apart: the archive's identity records, and the inbox's
# notices (one a job here, kept for their recipient, archived job or not).
ARCHIVE_TABLE, INBOX_TABLE = "jobs_archivedjob", "jobs_notice"


def _say(line: str) -> None:
    print(line, flush=True)


def _ask(count: int, user_id: int, tag: str, first: int) -> None:
    import jobs

    jobs.request_many(
        [
            {
                "kind": "demo.summary",
                "subject": ("horizon", f"{tag}-{first + i}"),
                "params": {"notify_user_id": user_id},
            }
            for i in range(count)
        ]
    )


def sample(minute_started) -> dict:
    """The figures of the minute that began at ``minute_started`` (the server's clock)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT sum(pg_total_relation_size(relid)), sum(n_dead_tup), sum(n_live_tup) "
            "FROM pg_stat_user_tables WHERE relname = ANY(%s)",
            [list(WORKING_SET)],
        )
        size, dead, live = cursor.fetchone()
        cursor.execute(
            "SELECT pg_total_relation_size(%s), (SELECT count(*) FROM jobs_archivedjob), "
            "pg_total_relation_size(%s)",
            [ARCHIVE_TABLE, INBOX_TABLE],
        )
        archive_bytes, archived, inbox_bytes = cursor.fetchone()
        cursor.execute(
            "SELECT (SELECT count(*) FROM jobs_job WHERE finished_at >= %s) + "
            "(SELECT count(*) FROM jobs_archivedjob WHERE finished_at >= %s)",
            [minute_started, minute_started],
        )
        (finished,) = cursor.fetchone()
        cursor.execute(
            "SELECT percentile_disc(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM "
            "a.started_at - j.created_at)) FROM jobs_attempt a JOIN jobs_job j ON j.id = "
            "a.job_id WHERE a.number = 1 AND a.started_at >= %s",
            [minute_started],
        )
        (pickup,) = cursor.fetchone()
    return {
        "bytes": int(size or 0),
        "dead": int(dead or 0),
        "live": int(live or 0),
        "archive_bytes": int(archive_bytes or 0),
        "inbox_bytes": int(inbox_bytes or 0),
        "archived": int(archived),
        "finished": int(finished),
        "p99_pickup_ms": None if pickup is None else float(pickup) * 1000,
    }


def _now():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def high_water(values: list[int]) -> list[int]:
    """Each minute's highest figure so far."""
    out, top = [], None
    for value in values:
        top = value if top is None else max(top, value)
        out.append(top)
    return out


def verdict(rows: list[dict]) -> list[str]:
    """The checks over the minutes' rows (see the module's docstring); failures, in words."""
    n = len(rows)
    if n < 6:
        return [f"{n} minutes: too short to judge (6 at least)"]
    third = n // 3
    failures = []
    for field in ("bytes", "dead"):
        # The high-water mark, not the minute's figure: dead tuples are a sawtooth (each
        # vacuum takes them back to near 0), and a sawtooth's two end points differ by
        # wherever the vacuums fell. A level that stays bounded stops raising its mark.
        mark = high_water([row[field] for row in rows])
        first = mark[third - 1] - mark[0]
        last = mark[-1] - mark[n - third - 1]
        if last > 0.05 * max(first, 1):
            failures.append(f"{field} grew {last:,} in the last third, {first:,} in the first")
    ref = rows[min(4, n - 1)]
    for field in ("finished", "p99_pickup_ms"):
        base = ref[field]
        for i, row in enumerate(rows[min(5, n - 1) :], start=min(5, n - 1) + 1):
            if base and row[field] is not None and abs(row[field] - base) > 0.15 * base:
                failures.append(f"minute {i}: {field} {row[field]:.0f} against {base:.0f} at 5")
                break
    return failures


def _own_server() -> tuple[pgcluster.Server, Path, str]:
    """A private PostgreSQL with the server's defaults (autovacuum on, as in production;
    this machine's shared server runs with it off, ``conf.d/90-ci.conf``): its URL."""
    folder = pgcluster.workdir("horizon-")
    server = pgcluster.Server("horizon", folder / "data", "127.0.0.1", pgcluster.free_port())
    pgcluster.initdb(server)
    server.start("-c max_connections=100")
    server.wait_ready(writable=True)
    return server, folder, f"postgres://{pgcluster.ROLE}@{server.host}:{server.port}/postgres"


def run(args: argparse.Namespace) -> int:
    own = None
    try:
        if args.own_server:
            own = _own_server()
        url = own[2] if own else scratchdb.server_url(purpose="the horizon drill")
    except scratchdb.NotPostgres as exc:
        _say(f"horizon: cannot run: {exc}")
        return 2
    name = f"horizon_{secrets.token_hex(5)}"
    work = ROOT / "var" / "horizon" / name
    (work / "logs").mkdir(parents=True)
    procs = None
    result = "horizon: FAIL interrupted"
    try:
        env, procs = scratch_project(
            url, name, work, SETTINGS_MODULE, SOAK_Q_WORKERS=str(args.workers)
        )
        from django.contrib.auth import get_user_model
        from django.db import connection

        from jobs import archive, retention

        user_id = get_user_model().objects.create_user("horizon-reader").pk
        window = retention.minimum_days()
        start_hosts(procs, env, work, args.hosts, tag="horizon")
        with connection.cursor() as cursor:
            cursor.execute("SHOW autovacuum")
            (autovacuum,) = cursor.fetchone()
        _say(
            f"horizon {name}: {args.minutes} min, {args.rate} jobs/s, {args.hosts} hosts x "
            f"{args.workers} workers, archive after {window * 86400:.0f} s, once a minute; "
            f"{'its own server' if own else 'DATABASE_URL'}'s autovacuum {autovacuum}"
        )
        _say(
            "minute | working set MB | dead tuples | live rows | archived (MB) | inbox MB | "
            "finished/min | p99 pickup ms | archive pass"
        )
        rows, asked = [], 0
        for minute in range(1, args.minutes + 1):
            began, began_at = time.monotonic(), _now()
            for second in range(60):
                _ask(args.rate, user_id, name, asked)
                asked += args.rate
                time.sleep(max(0.0, began + second + 1 - time.monotonic()))
            passed = archive.archive(older_than_days=window)
            row = sample(began_at)
            rows.append(row)
            pickup = row["p99_pickup_ms"]
            _say(
                f"{minute:6} | {row['bytes'] / 1e6:14.1f} | {row['dead']:11,} | "
                f"{row['live']:9,} | {row['archived']:,} ({row['archive_bytes'] / 1e6:.1f}) | "
                f"{row['inbox_bytes'] / 1e6:8.1f} | {row['finished']:12,} | "
                f"{'-' if pickup is None else f'{pickup:.0f}':>13} | "
                f"{passed.jobs:,} jobs in {passed.seconds:.2f} s"
            )
        failures = verdict(rows)
        for failure in failures:
            _say(f"  check failed: {failure}")
        last = rows[-1]
        summary = (
            f"minutes={args.minutes} asked={asked} working_set_mb={last['bytes'] / 1e6:.1f} "
            f"dead={last['dead']} archived={last['archived']}"
        )
        result = f"horizon: {'FAIL' if failures else 'PASS'} {summary}"
        return 1 if failures else 0
    except Exception as exc:
        if procs is not None:
            _say(procs.logs(tail=20))
        result = f"horizon: FAIL the drill could not run: {type(exc).__name__}: {exc}"
        return 2
    finally:
        tear_down(procs, url, name, work, passed=result.startswith("horizon: PASS"), say=_say)
        if own:
            pgcluster.remove(own[1], [own[0]])
        _say(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=60)
    parser.add_argument("--rate", type=int, default=10, help="jobs asked for a second")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="per host")
    parser.add_argument(
        "--shared-server",
        dest="own_server",
        action="store_false",
        help="use DATABASE_URL's server, not a private one with autovacuum on",
    )
    # SIGTERM ends the run as Ctrl-C does: the hosts stopped, the databases dropped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
