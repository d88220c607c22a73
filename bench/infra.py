"""Databases, qcluster processes and the clock the benchmarks share.

The benchmarks own their databases (``bench_*`` on the server ``DATABASE_URL``
names): they create them, empty them between runs and never touch another.
Each measured run starts real ``manage.py qcluster`` processes with the
production ``Q_CLUSTER`` (only the worker count changes) and watches the
database from a separate psycopg connection.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from jobs.testing import scratchdb
from jobs.testing.processes import Processes, group_alive

ROOT = Path(__file__).resolve().parent.parent
VAR = ROOT / "var" / "bench"
# Overridable, so benches of several checkouts on one server do not empty each other's tables.
E2E_DB = os.environ.get("BENCH_DB") or "bench_e2e"
LEDGER_DB = os.environ.get("BENCH_LEDGER_DB") or "bench_ledger"
HISTORY_DB = os.environ.get("BENCH_HISTORY_DB") or "bench_history"  # bench.history
HISTORY_BASE_DB = f"{HISTORY_DB}_0"  # its empty twin, measured beside it round by round
OWNED = (E2E_DB, LEDGER_DB, HISTORY_DB, HISTORY_BASE_DB)

# Tables a run fills; emptied (with their id sequences) before every run.
RUN_TABLES = [
    "jobs_notice",
    "jobs_effectevent",
    "jobs_effect",
    "jobs_artifact",
    "jobs_attempt",
    "jobs_job",
    "django_q_ormq",
    "django_q_task",
    # The fair share's tags: each claim's charge leaves a dead row and index entries,
    # which autovacuum (off here) would clear; a run starts from no tags, as the first.
    "jobs_tenantshare",
    "bench_plain_notice",  # the same-work plain tasks' notices (bench.models)
]


class NotPostgres(SystemExit):
    """Raised when DATABASE_URL does not name a PostgreSQL server."""


def server_url() -> str:
    """DATABASE_URL, refused unless it is PostgreSQL."""
    try:
        return scratchdb.server_url(purpose="make bench")
    except scratchdb.NotPostgres as exc:
        raise NotPostgres(
            f"{exc}\nRun e.g.: DATABASE_URL=postgres://root@127.0.0.1:5432/postgres make bench\n"
            "(the benchmarks create and use their own bench_* databases on that server)"
        ) from None


def db_url(name: str) -> str:
    """The server's URL with the database name replaced (libpq form, for psycopg)."""
    return scratchdb.with_database(server_url(), name)


def connect(name: str, **kwargs) -> psycopg.Connection:
    return psycopg.connect(db_url(name), autocommit=True, **kwargs)


def start_django() -> None:
    """Set up Django on ``bench.settings`` over a fresh ``bench_e2e`` database, as every
    measured run wants it: one signing key shared with the clusters (they run DEBUG off,
    as production does), the artifacts under the bench's folder, and no INFO logging in
    this process (the clusters keep theirs, in var/bench/*.log).

    A fresh database each time: rows of earlier runs would weigh on the figures, and a
    database migrated by another branch's migrations could not be migrated by this one.
    Refuses SQLite with a message before anything starts."""
    import logging

    import django

    server_url()
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    os.environ["BENCH_DB"] = E2E_DB
    os.environ.setdefault("SECRET_KEY", strong_secret_key())
    os.environ.setdefault("ARTIFACT_ROOT", str(artifact_root()))
    drop_database(E2E_DB)
    ensure_database(E2E_DB)
    django.setup()
    logging.disable(logging.INFO)


def ensure_database(name: str) -> None:
    assert name in OWNED, name
    scratchdb.create(server_url(), name, if_missing=True)


def drop_database(name: str) -> None:
    assert name in OWNED, name
    scratchdb.drop(server_url(), name)


def strong_secret_key() -> str:
    """A key ``permits.settings`` accepts with DEBUG off (made for this run only)."""
    import secrets

    return "bench-" + secrets.token_urlsafe(48)


def child_env(workers: int | None = None, **extra: str) -> dict[str, str]:
    """The clusters' environment: production settings mode (DEBUG off) unless BENCH_DEBUG=1."""
    env = dict(os.environ)
    debug = os.environ.get("BENCH_DEBUG") == "1"
    env.update(
        DEBUG="1" if debug else "0",
        ALLOWED_HOSTS=env.get("ALLOWED_HOSTS", "localhost"),
        DJANGO_SETTINGS_MODULE="bench.settings",
        BENCH_DB=E2E_DB,
        ARTIFACT_ROOT=str(artifact_root()),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")])),
    )
    if workers is not None:
        env["BENCH_WORKERS"] = str(workers)
    env.update(extra)
    return env


def artifact_root() -> Path:
    return VAR / "artifacts"


def reset_run_tables() -> None:
    """Empty the job, ledger and queue tables of the e2e database, and the artifact folder."""
    with connect(E2E_DB) as conn:
        conn.execute(f"TRUNCATE {', '.join(RUN_TABLES)} RESTART IDENTITY CASCADE")
        # The dispatcher's schedule would add its own messages mid-run; the hot path
        # never needs it (jobs are enqueued when they are asked for).
        conn.execute("DELETE FROM django_q_schedule")
    shutil.rmtree(artifact_root(), ignore_errors=True)
    artifact_root().mkdir(parents=True, exist_ok=True)


def vacuum_analyze(tables: list[str] | None = None) -> None:
    """What autovacuum would do (it is off on these machines): planner stats, no dead rows."""
    with connect(E2E_DB) as conn:
        for table in tables or RUN_TABLES:
            conn.execute(f"VACUUM ANALYZE {table}")


# --- processes -----------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()  # state ppid pgrp ... (comm may hold spaces)


def children(pid: int, *, zombies: bool = False) -> list[int]:
    """Direct children of ``pid``, oldest first (exited, unreaped ones only if asked)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields and int(fields[1]) == pid and (zombies or fields[0] != "Z"):
            found.append((int(fields[19]), int(entry.name)))  # starttime, pid
    return [p for _, p in sorted(found)]


def vm_hwm_kib(pid: int) -> int | None:
    """Peak resident set size of ``pid`` (VmHWM), in KiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, *, reaped_children: bool = False) -> float:
    """User + system CPU time ``pid`` has used so far (or its reaped children have)."""
    fields = _stat(pid)
    if not fields:
        return 0.0
    if reaped_children:
        return (int(fields[13]) + int(fields[14])) / TICK  # cutime, cstime
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


@dataclass
class Cluster:
    """One ``manage.py qcluster`` and its process tree."""

    workers: int
    popen: subprocess.Popen
    log_path: Path
    started: float
    _aux: tuple[int, int] | None = None  # (monitor, pusher), fixed once seen
    peak_rss: dict[int, int] = field(default_factory=dict)  # worker pid -> VmHWM KiB

    def roles(self) -> dict[str, list[int]]:
        """The cluster's processes by role.

        The sentinel forks the workers first, then the monitor and the pusher;
        django-q2 recycles a worker after ``recycle`` tasks (default 500), so
        later workers are whatever else the sentinel has forked.
        """
        sentinels = children(self.popen.pid)
        if not sentinels:
            return {}
        # A recycled worker's CPU stays readable until the sentinel reaps it.
        kids = children(sentinels[0], zombies=True)
        if self._aux is None and len(kids) >= self.workers + 2:
            self._aux = (kids[self.workers], kids[self.workers + 1])
        aux = self._aux or ()
        return {
            "workers": [k for k in kids if k not in aux],
            "monitor": [aux[0]] if aux else [],
            "pusher": [aux[1]] if aux else [],
            "sentinel": [self.popen.pid, sentinels[0]],
        }

    def sample_rss(self) -> None:
        for pid in self.roles().get("workers", []):
            hwm = vm_hwm_kib(pid)
            if hwm:
                self.peak_rss[pid] = max(hwm, self.peak_rss.get(pid, 0))

    def worker_pids(self) -> list[int]:
        return self.roles().get("workers", [])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and group_alive(self.popen.pid):
            time.sleep(0.02)


def processes(workers: int | None = None, **env: str) -> Processes:
    """The benchmarks' child processes: ``manage.py`` with ``bench.settings``, logs in VAR."""
    VAR.mkdir(parents=True, exist_ok=True)
    return Processes(
        child_env(workers, **env), VAR, command=(sys.executable, "manage.py"), cwd=ROOT
    )


def start_cluster(workers: int, label: str, **env: str) -> Cluster:
    (VAR / f"qcluster-{label}.log").unlink(missing_ok=True)
    proc = processes(workers, **env).start(f"qcluster-{label}", "qcluster")
    return Cluster(workers, proc.popen, proc.log_path, time.monotonic())


@contextlib.contextmanager
def cluster(workers: int, label: str, **env: str):
    c = start_cluster(workers, label, **env)
    try:
        yield c
    finally:
        c.stop()


def server_counters() -> dict[str, int]:
    """Cumulative counters of the e2e database, as the statistics collector has them.

    Read from the maintenance database so that reading them adds no transaction
    to ``bench_e2e``; callers close their own connections first (a backend
    flushes its counters when it exits).
    """
    with scratchdb.admin_connection(server_url()) as conn:
        row = conn.execute(
            "SELECT xact_commit, xact_rollback, "
            "pg_snapshot_xmax(pg_current_snapshot())::text::bigint "
            "FROM pg_stat_database WHERE datname = %s",
            [E2E_DB],
        ).fetchone()
    # ``xids``: transaction ids handed out on the whole server (a read-only transaction takes
    # none): the writing commits, which flush WAL. ``xact_commit`` counts every transaction
    # of the database, reads too (a worker's adopting read, an idle look).
    counters = {"xact_commit": row[0], "xact_rollback": row[1], "xids": row[2]}
    with connect(E2E_DB) as conn:
        for table, upd, hot, ins in conn.execute(
            "SELECT relname, n_tup_upd, n_tup_hot_upd, n_tup_ins FROM pg_stat_user_tables "
            "WHERE relname IN ('jobs_job', 'jobs_effect', 'django_q_ormq')"
        ):
            counters[f"{table}.upd"] = upd
            counters[f"{table}.hot"] = hot
            counters[f"{table}.ins"] = ins
    return counters


@dataclass
class Drain:
    """How a cluster worked through a queue that was full when it started."""

    total: int
    seconds: float  # first acknowledged message to the last
    wall: float  # cluster start to the last acknowledgement (start-up included)
    rss_kib: list[int] = field(default_factory=list)  # VmHWM of each worker process
    server: dict[str, float] = field(default_factory=dict)  # counter deltas per message
    cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU per message, by process role

    @property
    def rate(self) -> float:
        return self.total / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class Watched:
    """What watching a full queue drain saw."""

    seconds: float  # first to last acknowledgement, scaled to the whole queue
    ended: float  # monotonic time the queue was seen empty
    cpu_ms: dict[str, float]  # CPU per message by role, first to last acknowledgement
    polls: int  # the watcher's own transactions (taken off the server's commit count)


def watch_drain(
    watch: psycopg.Connection,
    total: int,
    *,
    cpu: Callable[[list], dict[str, float]],
    alive: Callable[[], bool],
    timeout: float,
    failure: Callable[[int, float], str],
    sample: Callable[[], None] | None = None,
) -> Watched:
    """Poll the queue until it is empty (``LEFT_SQL``); time and CPU from the first
    acknowledgement (or finished job) seen.

    Throughput counts from the first acknowledgement seen to the last, so a cluster's
    start-up (Django import, forks) is left out for both sides alike. ``cpu`` reads the
    clusters' cumulative CPU given their backends' pids; ``sample`` (RSS) runs every 25
    polls and at the end; ``failure`` says what was left if a cluster dies or time runs out.
    """
    backends = (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid()"
    )
    polls = 0
    first_t = first_left = None
    cpu_start: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while True:
        left = watch.execute(LEFT_SQL).fetchone()[0]
        polls += 1
        now = time.monotonic()
        if first_t is None and left < total:
            first_t, first_left = now, left
            cpu_start = cpu(watch.execute(backends).fetchall())
        if sample is not None and polls % 25 == 0:
            sample()
        if left == 0:
            cpu_end = cpu(watch.execute(backends).fetchall())
            if sample is not None:
                sample()
            polls += 1
            break
        if not alive() or now > deadline:
            raise RuntimeError(failure(left, now))
        time.sleep(0.02)
    # ``first_left`` messages were acknowledged between the two observations;
    # scale that stretch to the whole queue so that ``rate = total / seconds``.
    seconds = (now - first_t) * total / first_left if first_left else float("nan")
    cpu_ms = {
        role: (cpu_end[role] - cpu_start.get(role, 0.0)) * 1000 / first_left
        for role in cpu_end
        if first_left
    }
    return Watched(seconds, now, cpu_ms, polls)


# What is left of a run: its messages (plain tasks; a job's on the message brokers) or,
# where the jobs table is the queue (no message for a job), its unfinished jobs.
LEFT_SQL = (
    "SELECT GREATEST((SELECT count(*) FROM django_q_ormq), (SELECT count(*) FROM jobs_job "
    "WHERE state IN ('queued', 'retry_wait', 'running')))"
)


def counters_since(before: dict[str, int], polls: int) -> dict[str, int]:
    """The server's counters since ``before``, less the watcher's own polls."""
    time.sleep(0.3)  # the clusters' backends flush their counters as they exit
    after = server_counters()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    delta["xact_commit"] -= polls
    return delta


def drain(workers: int, label: str, total: int, *, timeout: float = 180.0, **env: str) -> Drain:
    """Start a cluster on a full queue; time until every message is acknowledged.

    The server's counters around the run give transactions and row updates per
    message (the watcher's own polls subtracted).
    """
    time.sleep(0.2)  # let the enqueueing backend's counters land
    before = server_counters()
    with connect(E2E_DB) as watch, cluster(workers, label, **env) as c:
        seen = watch_drain(
            watch,
            total,
            cpu=lambda rows: _cpu_by_role(c, rows),
            alive=c.alive,
            timeout=timeout,
            failure=lambda left, now: (
                f"{label}: {left} of {total} messages left after {now - c.started:.0f}s\n"
                f"{c.log_tail()}"
            ),
            sample=c.sample_rss,
        )
        rss = sorted(c.peak_rss.values(), reverse=True)
    server = {k: v / total for k, v in counters_since(before, seen.polls).items()}
    return Drain(total, seen.seconds, seen.ended - c.started, rss, server, seen.cpu_ms)


def _cpu_by_role(c: Cluster, backend_rows) -> dict[str, float]:
    """Cumulative CPU seconds of the cluster's processes by role, and of its database backends."""
    roles = c.roles()
    out = {role: sum(cpu_seconds(p) for p in pids) for role, pids in roles.items()}
    # Recycled workers' CPU moves to the sentinel's reaped-children counters.
    sentinel = roles.get("sentinel", [0, 0])[-1]
    out["workers"] = out.get("workers", 0.0) + cpu_seconds(sentinel, reaped_children=True)
    out["postgres backends"] = sum(cpu_seconds(pid) for (pid,) in backend_rows)
    return out
