"""The crash-and-fault soak: ``python -m tests.chaos.soak --jobs K`` (``make soak``, K=300).

Jepsen-style: inject the faults, record everything, then check the history.

1. A scratch PostgreSQL database (``soak_<random>``, created here, migrated with
   ``manage.py migrate``, dropped at the end) and a scratch folder
   ``var/soak/<name>/`` (artifacts, process logs, the provider's record; removed
   at the end unless ``--keep`` or a failed check).
2. Tenants, reviewers and permit requests; K ``permits.report`` jobs through
   ``permits.services`` (some at a second revision, a few malformed), plus
   ``drill.deadlock`` jobs that provoke a real PostgreSQL deadlock on their first
   attempt, and ``demo.summary`` jobs whose one in-app notice makes them publish in
   the one-statement publish (``jobs.sql``; reports, with a webhook notice, take the
   ORM publish), and ``soak.chain`` jobs (K/15) whose publish writes a group of two
   or three ``soak.part`` children and the group's one ``soak.join``
   (``tests.chaos.soak_kinds``). Half of the reports and chains wait in the queue
   before the workers start; the rest, and the deadlocks, arrive while the chaos
   runs, with a few reviewers revoked on the way (chosen while their notice is still
   on its way). Two periodic kinds tick from the dispatcher's first round to the
   end (``soak.tick`` every 5 s with ``catch_up="all"``, ``soak.digest`` every 3 s
   with ``"latest"``); the soak reads their ``ScheduleState`` at both ends, the window
   the checker holds the ticks to.
3. Three real ``manage.py jobs_worker`` processes (each runs and supervises a
   ``manage.py qcluster``) and ``manage.py jobs_dispatcher``, connected to the
   database through a relay that can go down (``tests.chaos.dbproxy``), and the
   stand-in provider (``manage.py fake_provider``) accepting-then-stalling a
   fraction of new sends past the read timeout and answering 503 to another.
4. A chaos loop SIGKILLs a worker child every few seconds (preferably one in the
   middle of a job or a send; the cluster's sentinel starts a new one) or, now
   and then, a whole qcluster's process group (its jobs_worker starts another);
   with ``--pause-fraction`` it also SIGSTOPs busy workers past their lease
   (zombies). Once, while requests still arrive, the database goes away for
   ``--db-outage`` seconds (7): new connections refused, open ones cut, as in a
   restart (``Outages``; the storage outage plugs in there). A watcher reads the
   running jobs' leases five times a second, on its own direct connection.
5. When every request is made and every job ended, the chaos stops; when every
   effect is final too (or at the deadline), the queue drains, the processes
   stop, and ``tests.chaos.checker`` checks every invariant of DESIGN.md against
   the database, the storage, the provider's record and the workers' logs. The
   figures are printed; exit 1 if any check failed, 2 if the soak could not run.

Only PostgreSQL: several worker processes, advisory locks and a real deadlock.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from jobs.testing.proctree import children, groups_of, process_table
from tests.chaos.dbproxy import DatabaseProxy

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_MODULE = "tests.chaos.soak_settings"  # the soak's timers and its own kinds
# A soak.debounced key's burst: requests this many seconds apart, well inside its window.
DEBOUNCE_BURST, DEBOUNCE_GAP = 5, 0.15
POSTGRES_SCHEMES = ("postgres", "postgresql", "pgsql")
TENANTS = [
    # springfield and shelbyville first: drill.deadlock locks those two rows.
    ("springfield", "Springfield Permit Office"),
    ("shelbyville", "Shelbyville Building Department"),
    ("ogdenville", "Ogdenville Permits"),
    ("north-haverbrook", "North Haverbrook Building Office"),
    ("capital-city", "Capital City Permit Center"),
    ("brockway", "Brockway Planning"),
]
# Every private applicant value carries this marker, so a leak of any of them
# (into a notice body, a log line or an error field) is found by one search.
PRIVATE_MARKER = "zzprivzz"


class Refused(Exception):
    """Raised when the soak cannot run here (no PostgreSQL); the message says why."""


@dataclass
class Config:
    jobs: int = 300
    tenants: int = 4
    clusters: int = 3
    workers: int = 2  # per cluster
    tenant_concurrency: int = 2
    provider_in_flight: int = 2
    lease: float = 2.0
    effect_lease: float = 4.0
    deadlock_fraction: float = 0.08
    summary_fraction: float = 0.1  # demo.summary jobs: in-app notice only
    chain_fraction: float = 1 / 15  # soak.chain jobs: a group of parts and a join each
    # soak.debounced keys, each asked for in one burst of DEBOUNCE_BURST requests
    debounce_fraction: float = 1 / 50
    malformed_fraction: float = 0.02
    revision_fraction: float = 0.15
    revoke_fraction: float = 0.04
    stall: float = 0.10
    unavailable: float = 0.10
    stall_seconds: float = 3.0
    read_timeout: float = 1.0
    connect_timeout: float = 1.0
    retry_after: float = 0.5
    chaos_interval: float = 3.0
    group_kill_fraction: float = 0.15
    # SIGSTOP pauses past the lease (zombies); off by default: see the soak's report.
    pause_fraction: float = 0.0
    # The database goes away (connections refused, open ones cut) this long, once.
    db_outage_seconds: float = 7.0
    db_outage_at: float | None = None  # seconds after the workers start; None: see below
    # The artifact storage fills up (a real full tmpfs) this long, once.
    storage_outage_seconds: float = 8.0
    storage_outage_at: float | None = None  # None: 70% into the arrival window
    backlog: float = 0.5
    arrival_seconds: float | None = None  # None: K / 6 seconds, at least 10
    timeout: float = 420.0
    drain_timeout: float = 40.0
    watch_period: float = 0.2
    seed: int | None = None
    keep: bool = False
    json_path: str | None = None
    # Flow rules set for the run (rows, changed like an operator would): checked by
    # tests.chaos.flow_checks at the provider's record and in the attempt slots.
    provider_rate: str | None = "5/s"
    ruled_tenant: str = "ogdenville"
    ruled_tenant_concurrency: int = 1

    @property
    def arrival(self) -> float:
        if self.arrival_seconds is not None:
            return self.arrival_seconds
        return max(10.0, self.jobs / 6)

    @property
    def db_outage_due(self) -> float:
        """While requests still arrive (so the chaos is on): 40% into the arrival window."""
        return self.db_outage_at if self.db_outage_at is not None else 0.4 * self.arrival

    @property
    def storage_outage_due(self) -> float:
        """After the database's, still inside the arrival window: 70% into it."""
        if self.storage_outage_at is not None:
            return self.storage_outage_at
        return 0.7 * self.arrival


# --- the scratch database ----------------------------------------------------------


def server_url() -> str:
    """DATABASE_URL, which must name a PostgreSQL server; Refused otherwise."""
    url = os.environ.get("DATABASE_URL", "")
    if not url:
        raise Refused(
            "the soak needs PostgreSQL, but DATABASE_URL is not set (the site would use "
            "SQLite). Run e.g. DATABASE_URL=postgres://root@127.0.0.1:5432/postgres make soak"
        )
    scheme = urlsplit(url).scheme.lower()
    if scheme not in POSTGRES_SCHEMES:
        raise Refused(
            f"the soak needs PostgreSQL (several worker processes, advisory locks, a real "
            f"deadlock), but DATABASE_URL names {scheme or 'no'!r} database. Set "
            "DATABASE_URL=postgres://USER@HOST:PORT/DB; the soak creates and drops its own "
            "scratch database on that server."
        )
    return url


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme="postgres", path=f"/{name}"))


def via_port(url: str, port: int) -> str:
    """``url`` with its server at 127.0.0.1:``port`` (the relay in front of it)."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    return urlunsplit(
        parts._replace(netloc=f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}")
    )


def _admin(url: str):
    """An autocommit connection to the server's maintenance database (or the URL's own)."""
    import psycopg

    try:
        return psycopg.connect(with_database(url, "postgres"), autocommit=True)
    except psycopg.OperationalError:
        return psycopg.connect(with_database(url, urlsplit(url).path.lstrip("/")), autocommit=True)


def create_database(url: str, name: str) -> None:
    with _admin(url) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')


def drop_database(url: str, name: str) -> None:
    """Drop the scratch database this run created (never another one)."""
    assert re.fullmatch(r"soak_[0-9a-f]{10}", name), name
    with _admin(url) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- processes ---------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    role: str  # cluster | dispatcher | provider
    popen: subprocess.Popen
    log: Path
    killed: bool = False  # killed on purpose: its exit is not a failure

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None


def _wait_for_log(proc: Proc, text: str, *, timeout: float) -> bool:
    """Wait until ``proc``'s log holds ``text`` (or it exited, or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.alive():
        if proc.log.exists() and text in proc.log.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def _proc_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (None when gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()[0]


def _group_members(pgid: int) -> list[int]:
    from jobs.supervisor import group_members

    return group_members(pgid)


class Fleet:
    """Every process this soak starts; each leads its own process group.

    A cluster slot is one ``manage.py jobs_worker``: it runs ``qcluster`` as a child in
    a process group of its own and restarts it when it exits or stops making progress
    (the django-q2 wedge). The chaos kills that child's workers, or its whole group;
    jobs_worker brings the cluster back, and its log says when and why.
    """

    def __init__(self, env: dict, log_dir: Path):
        self.env = env
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.clusters: dict[str, Proc] = {}
        self.incarnations: dict[str, int] = defaultdict(int)
        self.dispatcher: Proc | None = None
        self.unexpected: list[str] = []
        # What each cluster's log said, read incrementally: proc pid -> read offset and
        # the worker pids it announced.
        self._offset: dict[int, int] = defaultdict(int)
        self._announced: dict[int, set[int]] = defaultdict(set)
        # slot -> since when it has had fewer live workers than configured
        self._short_since: dict[str, float] = {}
        self._next_census = 0.0
        # slot -> pid (= process group) of the qcluster its jobs_worker runs, and when read
        self._qclusters: dict[str, int | None] = {}
        self._qclusters_at = 0.0

    def start(self, name: str, role: str, *args: str, stdout=None) -> Proc:
        log = self.log_dir / f"{name}.log"
        fh = open(log, "ab")  # noqa: SIM115 - the child owns it; closed after Popen
        try:
            popen = subprocess.Popen(
                [sys.executable, str(ROOT / "manage.py"), *args],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=stdout if stdout is not None else fh,
                stderr=fh if stdout is not None else subprocess.STDOUT,
                start_new_session=True,  # pgid == pid: a whole process group can be killed
            )
        finally:
            fh.close()
        proc = Proc(name, role, popen, log)
        self.procs.append(proc)
        return proc

    def start_cluster(self, slot: str) -> Proc:
        self._short_since.pop(slot, None)
        self.incarnations[slot] += 1
        proc = self.start(
            f"{slot}.{self.incarnations[slot]}", "cluster", "jobs_worker", "--stop-timeout=5"
        )
        self.clusters[slot] = proc
        self._qclusters_at = 0.0
        return proc

    def start_dispatcher(self) -> Proc:
        n = sum(1 for p in self.procs if p.role == "dispatcher") + 1
        self.dispatcher = self.start(
            f"dispatcher.{n}", "dispatcher", "jobs_dispatcher", "--interval", "0.5"
        )
        return self.dispatcher

    def qcluster(self, slot: str) -> int | None:
        """The qcluster the slot's jobs_worker runs now (its pid leads its group), if any."""
        if time.monotonic() - self._qclusters_at > 0.2:
            table = process_table()
            self._qclusters = {
                s: next(iter(children(p.pid, table)), None) if p.alive() else None
                for s, p in self.clusters.items()
            }
            self._qclusters_at = time.monotonic()
        return self._qclusters.get(slot)

    def cluster_of(self, pid: int) -> str | None:
        """Which cluster slot ``pid`` belongs to (None when it is not one of ours)."""
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            return None
        for slot in self.clusters:
            if self.qcluster(slot) == pgid:
                return slot
        return None

    def _read_log(self, slot: str) -> None:
        """Take in the whole lines a cluster's log gained since the last read."""
        proc = self.clusters[slot]
        try:
            with open(proc.log, "rb") as fh:
                fh.seek(self._offset[proc.pid])
                chunk = fh.read()
        except OSError:
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written is read next time
        self._offset[proc.pid] += len(complete)
        self._announced[proc.pid] |= {
            int(m) for m in re.findall(rb"ready for work at (\d+)", complete)
        }

    def worker_pids(self, slot: str) -> list[int]:
        """Live django-q2 worker children of a cluster, as its log announced them."""
        proc = self.clusters[slot]
        self._read_log(slot)
        main = self.qcluster(slot)
        return sorted(
            pid
            for pid in self._announced[proc.pid]
            if pid not in (proc.pid, main)
            and _proc_state(pid) not in (None, "Z")
            and self.cluster_of(pid) == slot
        )

    def kill_group(self, proc: Proc) -> None:
        """SIGKILL a process and everything it started; wait until their groups are gone."""
        proc.killed = True
        groups = groups_of(proc.pid)
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_group_members(g) for g in groups):
            time.sleep(0.05)

    def kill_qcluster(self, slot: str) -> int | None:
        """SIGKILL the whole process group of a slot's qcluster (its jobs_worker restarts it)."""
        pgid = self.qcluster(slot)
        if pgid is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _group_members(pgid):
            time.sleep(0.05)
        self._qclusters_at = 0.0
        return pgid

    def supervise(self, workers: int) -> list[str]:
        """Restart what died without being killed on purpose, or was not replaced.

        jobs_worker is the supervisor of its cluster: it restarts a qcluster that
        exited or stopped making progress (django-q2 issue #23, the wedge: a worker
        killed while it waited for the next task dies holding the lock of the
        cluster's task queue and the cluster delivers nothing; see jobs.supervisor).
        Its own exit, or the dispatcher's, is a fault here. A killed worker child is
        replaced by its cluster's sentinel (django-q2's guard); a cluster with fewer
        workers than configured twenty seconds later is a fault too, and its qcluster
        group is killed (jobs_worker starts another).
        """
        restarted = []
        for slot, proc in list(self.clusters.items()):
            if not proc.alive() and not proc.killed:
                self.unexpected.append(f"{proc.name} exited with {proc.popen.returncode}")
                self.kill_group(proc)
                self.start_cluster(slot)
                restarted.append(slot)
        # Once a second, count each cluster's live workers. The sentinel replaces a
        # dead worker within its guard cycle (0.5 s); twenty seconds short is a fault.
        now = time.monotonic()
        if now >= self._next_census:
            self._next_census = now + 1.0
            for slot, proc in list(self.clusters.items()):
                running = proc.alive() and self.qcluster(slot) is not None
                have = len(self.worker_pids(slot)) if running else workers
                if have >= workers:
                    self._short_since.pop(slot, None)
                    continue
                if now - self._short_since.setdefault(slot, now) > 20:
                    self.unexpected.append(
                        f"{proc.name} ran with {have} of {workers} workers for 20 s"
                    )
                    self._short_since.pop(slot, None)
                    self.kill_qcluster(slot)
                    restarted.append(f"{slot} (short of workers)")
        if self.dispatcher is not None and not self.dispatcher.alive():
            if not self.dispatcher.killed:
                self.unexpected.append(
                    f"{self.dispatcher.name} exited with {self.dispatcher.popen.returncode}"
                )
            self.start_dispatcher()
            restarted.append("dispatcher")
        return restarted

    def restarts(self) -> dict[str, list[str]]:
        """What each jobs_worker logged about restarting its qcluster, by reason."""
        out: dict[str, list[str]] = {"exited": [], "stalled": []}
        for proc in self.procs:
            if proc.role != "cluster":
                continue
            for line in proc.log.read_text(errors="replace").splitlines():
                if '"restart_reason"' not in line:
                    continue
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)  # LOG_FORMAT=json
                    out.setdefault(entry["restart_reason"], []).append(
                        f"{proc.name}: {entry['message'][:160]}"
                    )
        return out

    def stop_all(self) -> None:
        # Every group first (each jobs_worker's qcluster has its own), then the kills.
        groups = {g for p in self.procs if p.role != "provider" for g in groups_of(p.pid)}
        for proc in self.procs:
            if proc.role != "provider":
                proc.killed = True
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        for proc in self.procs:
            if proc.role != "provider":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_group_members(g) for g in groups):
            time.sleep(0.05)

    def stop_provider(self) -> None:
        for proc in self.procs:
            if proc.role == "provider" and proc.alive():
                proc.killed = True
                proc.popen.send_signal(signal.SIGTERM)
                try:
                    proc.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.popen.wait(timeout=10)


# --- the watcher -------------------------------------------------------------------


class Watcher(threading.Thread):
    """Reads every running job's lease five times a second (one statement, one snapshot).

    Three uses: the per-tenant count of live leases in each snapshot (the engine's
    own definition of the bound, measured directly); the lease values each owner
    wrote, which tell when a crashed attempt's lease really ran out
    (``tests.chaos.checker.attempt_slots``); and the jobs seen still running under
    an owner whose lease had already expired (invariant 3: that owner must not
    publish).
    """

    SQL = (
        "SELECT id, tenant_key, lease_owner, extract(epoch from lease_expires_at),"
        " extract(epoch from statement_timestamp()) FROM jobs_job WHERE state = 'running'"
    )

    def __init__(self, period: float):
        super().__init__(name="soak-watcher", daemon=True)
        self.period = period
        self.stopping = threading.Event()
        # (job, owner) -> [(first seen at, lease expires at)], one entry per lease value
        self.leases: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
        self.peaks: dict[str, tuple[int, float, list[int]]] = {}
        # (job, owner) -> when a snapshot first showed the job still running under
        # that owner with its lease already expired (before anyone reclaimed it)
        self.expired: dict[tuple[int, str], float] = {}
        self.samples = 0
        self.errors = 0
        self.max_gap = 0.0

    def run(self) -> None:
        from django.db import connection

        last = None
        try:
            while not self.stopping.wait(self.period):
                try:
                    with connection.cursor() as cursor:
                        cursor.execute(self.SQL)
                        rows = cursor.fetchall()
                except Exception:  # a hiccup is a gap in the samples, reported as such
                    self.errors += 1
                    connection.close()
                    continue
                now = time.time()
                if last is not None:
                    self.max_gap = max(self.max_gap, now - last)
                last = now
                self.samples += 1
                live: dict[str, list[int]] = defaultdict(list)
                for job, tenant, owner, expires, at in rows:
                    expires, at = float(expires), float(at)
                    seen = self.leases[(job, owner)]
                    if not seen or seen[-1][1] != expires:
                        seen.append((at, expires))
                    if expires <= at:
                        self.expired.setdefault((job, owner), at)
                    elif tenant:
                        live[tenant].append(job)
                for tenant, jobs in live.items():
                    if len(jobs) > self.peaks.get(tenant, (0,))[0]:
                        self.peaks[tenant] = (len(jobs), at, sorted(jobs))
        finally:
            connection.close()

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)


# --- the plan: what gets requested, revoked and asked again, and when -------------------


@dataclass
class Expect:
    """What the checker expects of one job."""

    job: int
    kind: str  # report | revision | malformed | deadlock | summary | chain
    tenant: str
    permit: int | None
    revision: int
    recipients: list[int]
    requested_at: float


@dataclass
class Revocation:
    permit: int
    user: int
    at: float  # after the revocation committed


@dataclass
class World:
    expects: dict[int, Expect] = field(default_factory=dict)
    revocations: list[Revocation] = field(default_factory=list)
    asked_again: int = 0
    again_mismatch: list[str] = field(default_factory=list)
    permits: dict[int, list[int]] = field(default_factory=dict)  # permit -> reviewers
    # soak.debounced requests in the order made: (key, seq, the job it reached; None when
    # it was refused: its identity's job was claimed already and kept its params)
    debounced: list[tuple[int, int, int | None]] = field(default_factory=list)


@dataclass(order=True)
class Action:
    due: float
    seq: int
    kind: str = field(compare=False)
    arg: tuple = field(compare=False, default=())


def seed(cfg: Config, rng: random.Random) -> tuple[World, list[Action]]:
    """Create tenants, reviewers and permits; return the plan of requests over time."""
    from decimal import Decimal

    from django.contrib.auth import get_user_model

    from permits.models import PermitRequest, Tenant
    from permits.services import assign_reviewer

    world = World()
    User = get_user_model()
    tenants = []
    reviewers: dict[str, list] = {}
    for key, name in TENANTS[: max(2, cfg.tenants)]:
        tenant, _ = Tenant.objects.get_or_create(key=key, defaults={"name": name})
        tenants.append(tenant)
        reviewers[key] = [
            User.objects.create_user(username=f"soak-{key}-{n}", password=None) for n in range(1, 4)
        ]

    malformed = max(1, round(cfg.jobs * cfg.malformed_fraction))
    second = round((cfg.jobs - malformed) * cfg.revision_fraction / (1 + cfg.revision_fraction))
    first = cfg.jobs - malformed - second
    deadlocks = max(2, round(cfg.jobs * cfg.deadlock_fraction))
    work_types = list(PermitRequest.WorkType.values)
    permits = []
    for i in range(first):
        tenant = rng.choice(tenants)
        permit = PermitRequest.objects.create(
            tenant=tenant,
            reference=f"SOAK-{i:05d}",
            site_address=f"{100 + i} Soak Street",
            parcel=f"SK-{i:05d}",
            work_type=rng.choice(work_types),
            description="Plans and specifications as submitted with the application.",
            valuation=Decimal(rng.randrange(2_000, 900_000)),
            status=PermitRequest.Status.IN_REVIEW,
            applicant_name=f"Ada Zzprivzz {i}",
            applicant_phone=f"+1 555 {i:05d} zzprivzz",
            applicant_email=f"ada{i}.zzprivzz@example.org",
            applicant_id_number=f"ZZPRIVZZ-{i:05d}",
        )
        chosen = rng.sample(reviewers[tenant.key], 2 if rng.random() < 0.2 else 1)
        for user in chosen:
            assign_reviewer(permit, user)
        world.permits[permit.pk] = [u.pk for u in chosen]
        permits.append(permit.pk)

    # Times are seconds after the workers start; the backlog is requested before (t=0).
    def when() -> float:
        return 0.0 if rng.random() < cfg.backlog else rng.uniform(0.2, cfg.arrival)

    plan: list[Action] = []
    seq = iter(range(1_000_000))
    due_of: dict[int, float] = {}
    for pk in permits:
        due_of[pk] = when()
        plan.append(Action(due_of[pk], next(seq), "report", (pk,)))
    for pk in rng.sample(permits, second):
        plan.append(
            Action(due_of[pk] + rng.uniform(0.5, cfg.arrival / 2), next(seq), "revision", (pk,))
        )
    for i in range(malformed):
        plan.append(Action(when(), next(seq), "malformed", (i, rng.choice(tenants).key)))
    for i in range(deadlocks):
        # Spread out, not in the backlog: two provocations running at once can wait on
        # each other through a thread event PostgreSQL cannot see (permits.drill), and
        # hang until django-q2's timeout instead of deadlocking in the database.
        plan.append(Action(rng.uniform(0.2, cfg.arrival), next(seq), "deadlock", (i,)))
    for i in range(max(2, round(cfg.jobs * cfg.summary_fraction))):
        # In-app only: these publish in the one statement (reports, with their webhook
        # notice, take the ORM publish that also enqueues the notice's message).
        tenant = rng.choice(tenants)
        user = rng.choice(reviewers[tenant.key])
        plan.append(Action(when(), next(seq), "summary", (i, tenant.key, user.pk)))
    for i in range(max(2, round(cfg.jobs * cfg.chain_fraction))):
        # The engine requests the parts and the join: the soak asks only for the parent.
        tenant = rng.choice(tenants)
        plan.append(Action(when(), next(seq), "chain", (i, tenant.key, rng.choice((2, 3)))))
    for key in range(max(2, round(cfg.jobs * cfg.debounce_fraction))):
        # One burst a key, well inside the window: one job, the last request's params.
        start, tenant = rng.uniform(0.2, cfg.arrival), rng.choice(tenants).key
        for n in range(DEBOUNCE_BURST):
            plan.append(Action(start + n * DEBOUNCE_GAP, next(seq), "debounce", (key, n, tenant)))
    for _ in range(max(1, round(first * cfg.revoke_fraction))):
        # The target is chosen when the time comes (see ``perform``).
        plan.append(Action(rng.uniform(1.0, cfg.arrival), next(seq), "revoke", ()))
    for pk in rng.sample(permits, max(1, first // 20)):
        plan.append(Action(due_of[pk] + rng.uniform(0.0, 3.0), next(seq), "again", (pk,)))
    plan.sort()
    return world, plan


def revocation_target(world: World, rng: random.Random) -> tuple[int, int] | None:
    """A (permit, reviewer) whose notice is published but not yet delivered, if any.

    Revoking then makes the release's authorization recheck matter (invariant 6):
    the notice must be withheld. Failing that, a reviewer of a job not yet
    finished, else of any permit requested so far.
    """
    from jobs.models import Effect, Job

    done = {(v.permit, v.user) for v in world.revocations}
    requested = {e.permit for e in world.expects.values() if e.permit is not None}
    waiting = (
        Effect.objects.filter(
            provider="webhook",
            state__in=[Effect.State.PENDING, Effect.State.UNKNOWN, Effect.State.SENDING],
        )
        .values_list("job__subject_id", "recipient")
        .order_by("id")
    )
    candidates = [(int(p), int(u)) for p, u in waiting if (int(p), int(u)) not in done]
    if not candidates:
        unfinished = Job.objects.exclude(state__in=Job.TERMINAL).filter(
            kind="permits.report", subject_id__in=[str(p) for p in requested]
        )
        candidates = [
            (int(p), u)
            for p in unfinished.values_list("subject_id", flat=True)
            for u in world.permits.get(int(p), [])
            if (int(p), u) not in done
        ]
    if not candidates:
        candidates = [(p, u) for p in requested for u in world.permits[p] if (p, u) not in done]
    return rng.choice(sorted(candidates)) if candidates else None


def perform(action: Action, world: World, rng: random.Random) -> None:
    """Carry out one planned request, revocation or second ask."""
    from django.contrib.auth import get_user_model

    import jobs
    from permits import reports
    from permits.drill import DEADLOCK_KIND
    from permits.models import PermitRequest
    from permits.services import report_request, request_new_revision, revoke_reviewer
    from tests.chaos import soak_kinds
    from tests.jobs.helpers import request_job

    now = time.time()
    if action.kind == "report":
        (pk,) = action.arg
        permit = PermitRequest.objects.select_related("tenant").get(pk=pk)
        job, _ = report_request(permit, revision=1)
        world.expects[job.pk] = Expect(
            job.pk, "report", permit.tenant.key, pk, 1, world.permits[pk], now
        )
    elif action.kind == "revision":
        (pk,) = action.arg
        permit = PermitRequest.objects.select_related("tenant").get(pk=pk)
        job, _ = request_new_revision(permit, seen_revision=1)
        world.expects[job.pk] = Expect(
            job.pk, "revision", permit.tenant.key, pk, 2, world.permits[pk], now
        )
    elif action.kind == "malformed":
        i, tenant = action.arg
        job, _ = request_job(
            reports.KIND,
            subject_type=reports.SUBJECT_TYPE,
            subject_id=f"soak-malformed-{i}",
            tenant_key=tenant,
        )
        world.expects[job.pk] = Expect(job.pk, "malformed", tenant, None, 1, [], now)
    elif action.kind == "summary":
        i, tenant, user_id = action.arg
        job, _ = request_job(
            "demo.summary",
            subject_type="soak.summary",
            subject_id=f"soak-summary-{i}",
            tenant_key=tenant,
            params={"notify_user_id": user_id},
        )
        world.expects[job.pk] = Expect(job.pk, "summary", tenant, None, 1, [user_id], now)
    elif action.kind == "chain":
        i, tenant, parts = action.arg
        job, _ = request_job(
            soak_kinds.CHAIN,
            subject_type=soak_kinds.CHAIN_SUBJECT,
            subject_id=f"soak-chain-{i}",
            tenant_key=tenant,
            params={"chain": i, "parts": parts},
        )
        world.expects[job.pk] = Expect(job.pk, "chain", tenant, None, 1, [], now)
    elif action.kind == "debounce":
        key, seq, tenant = action.arg
        try:
            handle = jobs.request(
                soak_kinds.DEBOUNCED,
                (soak_kinds.DEBOUNCE_SUBJECT, f"key-{key}"),
                params={"seq": seq},
                tenant=tenant,
            )
        except jobs.JobConflict:  # claimed already: it keeps the params it was claimed with
            world.debounced.append((key, seq, None))
            return
        pk = handle.job.pk
        world.debounced.append((key, seq, pk))
        if pk not in world.expects:
            world.expects[pk] = Expect(pk, "debounced", tenant, None, 1, [], now)
    elif action.kind == "deadlock":
        (i,) = action.arg
        job, _ = request_job(DEADLOCK_KIND, subject_type="drill", subject_id=f"deadlock-{i}")
        world.expects[job.pk] = Expect(job.pk, "deadlock", "", None, 1, [], now)
    elif action.kind == "revoke":
        target = revocation_target(world, rng)
        if target is None:
            return
        pk, user = target
        revoke_reviewer(PermitRequest.objects.get(pk=pk), get_user_model().objects.get(pk=user))
        world.revocations.append(Revocation(pk, user, time.time()))
    elif action.kind == "again":
        (pk,) = action.arg
        permit = PermitRequest.objects.select_related("tenant").get(pk=pk)
        first = next(e for e in world.expects.values() if e.permit == pk and e.revision == 1)
        job, created = report_request(permit, revision=1)
        world.asked_again += 1
        if created or job.pk != first.job:
            world.again_mismatch.append(f"permit {pk}: job {job.pk} (created={created})")
    else:  # pragma: no cover - a typo in the plan
        raise ValueError(action.kind)


# --- outages of a dependency ------------------------------------------------------


@dataclass
class Outage:
    """One dependency outage the chaos injects: what, when, how long; what happened."""

    what: str  # database | storage
    due: float  # seconds after the workers started
    seconds: float
    began: float | None = None  # wall clock
    ended: float | None = None
    detail: str = ""


class FullDisk:
    """The artifact root as a small tmpfs that a ballast file can fill (needs root).

    ``begin`` fills it to ENOSPC, so every artifact write fails as on a full disk;
    ``end`` deletes the ballast. Without root (no mount) the storage outage is skipped.
    """

    def __init__(self, root: Path, size: str = "64m"):
        self.root, self.size = root, size
        self.ballast = root / ".ballast"
        self.mounted = False

    def mount(self) -> bool:
        self.root.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0750", "tmpfs", str(self.root)],
            capture_output=True,
            text=True,
        )
        self.mounted = done.returncode == 0
        return self.mounted

    def begin(self) -> None:
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * 65536)
        finally:
            os.close(fd)

    def end(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.ballast.unlink()

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.root)], check=False)
            self.mounted = False


class Outages:
    """Begin and end the planned outages on time.

    ``switches`` maps what goes away to its (begin, end) pair. The database's is the
    relay the workers connect through (``tests.chaos.dbproxy``: down refuses new
    connections and cuts the open ones, as a restarted server does). Hook for the
    storage outage (issue 10, item 4): add ``"storage": (begin, end)`` making the
    artifact root unwritable (full or read-only) and freeing it again, and an
    ``Outage("storage", ...)`` to the plan in ``run``; the checker then reports it
    with the others and every invariant must still hold.
    """

    def __init__(self, plan: list[Outage], switches: dict[str, tuple[Callable, Callable]]):
        self.plan = sorted(plan, key=lambda o: o.due)
        self.switches = switches

    def tick(self, elapsed: float) -> list[str]:
        """Begin what is due, end what has lasted long enough; return what changed."""
        said = []
        for outage in self.plan:
            if outage.began is None and elapsed >= outage.due:
                self.switches[outage.what][0]()
                outage.began = time.time()
                said.append(f"{outage.what} outage begins ({outage.seconds:g} s)")
            elif (
                outage.began is not None
                and outage.ended is None
                and time.time() - outage.began >= outage.seconds
            ):
                # The database answers again some time during the switch: its end is
                # when the switch began (a round right after it may already reach it).
                switching = time.time()
                self.switches[outage.what][1]()
                outage.ended = switching
                said.append(f"{outage.what} back after {outage.ended - outage.began:.1f} s")
        return said

    @property
    def pending(self) -> bool:
        return any(o.ended is None for o in self.plan)

    def end_all(self) -> None:
        for outage in self.plan:
            if outage.began is not None and outage.ended is None:
                switching = time.time()
                self.switches[outage.what][1]()
                outage.ended = switching


# --- chaos ---------------------------------------------------------------------------


@dataclass
class Kill:
    """One fault the chaos injected: a SIGKILL, or a SIGSTOP..SIGCONT pause."""

    at: float
    what: str  # mid-job | mid-send | idle-worker | cluster | pause-job | pause-send
    cluster: str
    pid: int
    subject: str = ""
    seconds: float = 0.0  # how long a pause lasted


def _pid_of(identity: str) -> int | None:
    host, _, rest = identity.partition(":")
    pid = rest.split(":", 1)[0]
    return int(pid) if host == socket.gethostname() and pid.isdigit() else None


def busy_workers(fleet: Fleet) -> list[tuple[str, int, str, str]]:
    """(what, pid, cluster, subject) for workers holding a live job or send lease now."""
    from django.utils import timezone

    from jobs.models import Effect, Job

    now = timezone.now()
    out = []
    rows = [
        ("mid-job", owner, f"job {pk}")
        for owner, pk in Job.objects.filter(
            state=Job.State.RUNNING, lease_expires_at__gt=now
        ).values_list("lease_owner", "pk")
    ] + [
        ("mid-send", owner, f"effect {pk}")
        for owner, pk in Effect.objects.filter(
            state=Effect.State.SENDING, lease_expires_at__gt=now
        ).values_list("lease_owner", "pk")
    ]
    for what, owner, subject in rows:
        pid = _pid_of(owner)
        slot = fleet.cluster_of(pid) if pid else None
        if slot is not None and pid != fleet.qcluster(slot):
            out.append((what, pid, slot, subject))
    return out


def next_fault(cfg: Config, rng: random.Random) -> str:
    """What the next chaos event will be: cluster, pause or kill."""
    roll = rng.random()
    if roll < cfg.group_kill_fraction:
        return "cluster"
    if roll < cfg.group_kill_fraction + cfg.pause_fraction:
        return "pause"
    return "kill"


def chaos_once(
    fleet: Fleet,
    cfg: Config,
    rng: random.Random,
    fault: str,
    *,
    patient: bool,
    paused: dict[int, float],
) -> Kill | None:
    """Inject ``fault``; None to try again on the next tick (nobody busy yet, ``patient``).

    ``kill`` SIGKILLs one worker child, preferably one in the middle of a job or a
    send (its sentinel starts another); ``cluster`` SIGKILLs a whole qcluster's process
    group (its jobs_worker starts another); ``pause`` SIGSTOPs a busy worker for longer than its
    lease (SIGCONT comes from the main loop, ``paused``): a zombie that must publish
    nothing once another worker took over.
    """
    alive = [slot for slot in fleet.clusters if fleet.qcluster(slot) is not None]
    if not alive:
        return None
    if fault == "cluster":
        slot = rng.choice(alive)
        pgid = fleet.kill_qcluster(slot)
        if pgid is None:
            return None
        return Kill(time.time(), "cluster", slot, pgid, fleet.clusters[slot].name)
    busy = [b for b in busy_workers(fleet) if b[1] not in paused]
    if fault == "pause":
        if not busy:
            return (
                None
                if patient
                else chaos_once(fleet, cfg, rng, "kill", patient=False, paused=paused)
            )
        what, pid, slot, subject = rng.choice(busy)
        # Past the job's lease, or past the sending lease for a worker mid-send.
        held = cfg.lease if what == "mid-job" else cfg.effect_lease
        seconds = held + rng.uniform(0.5, 1.5)
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return None
        paused[pid] = time.monotonic() + seconds
        return Kill(time.time(), what.replace("mid", "pause"), slot, pid, subject, seconds)
    if busy and rng.random() < 0.8:
        what, pid, slot, subject = rng.choice(busy)
    elif patient and rng.random() < 0.8:
        return None  # wait a tick for a worker in the middle of something
    else:
        idle = [(slot, pid) for slot in alive for pid in fleet.worker_pids(slot)]
        if not idle:
            return None
        slot, pid = rng.choice(idle)
        what, subject = "idle-worker", ""
    # The pid was checked to be in one of our clusters' process groups just now.
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    paused.pop(pid, None)
    return Kill(time.time(), what, slot, pid, subject)


def resume_due(paused: dict[int, float], *, everyone: bool = False) -> None:
    """SIGCONT the paused workers whose pause is over (all of them with ``everyone``)."""
    now = time.monotonic()
    for pid, until in list(paused.items()):
        if everyone or until <= now:
            del paused[pid]
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


# --- the run -------------------------------------------------------------------------


def _say(line: str) -> None:
    print(line, flush=True)


def progress() -> tuple[bool, bool, str]:
    """(every job terminal, every effect final, a one-line summary)."""
    from django.db.models import Count

    from jobs.models import Effect, Job

    jobs = dict(Job.objects.values_list("state").annotate(n=Count("id")).order_by())
    effects = dict(Effect.objects.values_list("state").annotate(n=Count("id")).order_by())
    open_jobs = sum(n for s, n in jobs.items() if s not in Job.TERMINAL)
    open_effects = sum(n for s, n in effects.items() if s not in Effect.FINAL)
    text = "jobs " + " ".join(f"{s}={n}" for s, n in sorted(jobs.items()))
    text += " | effects " + " ".join(f"{s}={n}" for s, n in sorted(effects.items()))
    return open_jobs == 0, open_effects == 0, text


def release_sequence_holders() -> int:
    """An operator's release (the console's) of each failed or dead job holding its
    sequence: the site's reports are one sequence per permit request, and a report the
    kills spent, or a malformed one, holds the permit's later revisions until then."""
    from jobs import sequences

    return sum(
        sequences.release(b.holder, operator="soak-operator")
        for b in sequences.blocked()
        if b.releasable
    )


def tick_marks() -> dict:
    """The last tick requested per periodic soak kind (its ``ScheduleState.last_tick``).

    Read once the dispatcher's first round made the rows (a new schedule starts there,
    with no job) and again just before each ``progress``: the ticks after the first read
    up to the read before the last ``progress`` are the window the checker holds to
    one job each and the catch-up policy. Later ticks (the dispatcher runs on while the
    queue drains) are left out.
    """
    from jobs.models import ScheduleState
    from tests.chaos import soak_kinds

    rows = ScheduleState.objects.filter(kind__in=list(soak_kinds.PERIODIC))
    return dict(rows.values_list("kind", "last_tick"))


def queue_left() -> int:
    """Job and effect messages not yet acknowledged (the dispatcher's schedule aside)."""
    from django_q.models import OrmQ

    funcs = {"jobs.tasks.run_job", "jobs.tasks.release_effect"}
    return sum(1 for m in OrmQ.objects.all() if m.func() in funcs)


def run(cfg: Config) -> int:
    """Run the soak end to end; returns the exit status (0: every invariant held)."""
    url = server_url()
    started = time.monotonic()
    rng = random.Random(cfg.seed)
    name = f"soak_{secrets.token_hex(5)}"
    work = ROOT / "var" / "soak" / name
    logs = work / "logs"
    logs.mkdir(parents=True)
    record = work / "provider.sqlite3"
    artifacts = work / "artifacts"
    scratch = with_database(url, name)
    token = secrets.token_urlsafe(16)
    created = passed = False
    fleet: Fleet | None = None
    watcher: Watcher | None = None
    # The processes reach the database through a relay that can go down; this process
    # (the watcher, the requests, the checker) connects directly.
    server = urlsplit(scratch)
    proxy = DatabaseProxy(server.hostname or "127.0.0.1", server.port or 5432).start()
    disk = FullDisk(artifacts)
    outages = Outages([], {"database": (proxy.down, proxy.up), "storage": (disk.begin, disk.end)})
    if cfg.db_outage_seconds > 0:
        outages.plan.append(Outage("database", cfg.db_outage_due, cfg.db_outage_seconds))
    if cfg.storage_outage_seconds > 0:
        if disk.mount():
            outages.plan.append(
                Outage("storage", cfg.storage_outage_due, cfg.storage_outage_seconds)
            )
        else:
            _say("storage outage skipped: mounting a tmpfs for the artifact root needs root")
    try:
        create_database(url, name)
        created = True
        _say(
            f"soak {name}: {cfg.jobs} report jobs (and deadlocks, summaries, chains, ticks), "
            f"scratch database {name}, folder {work}"
        )
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TEST_DATABASE_NAME", "DJANGO_SETTINGS_MODULE")
        }
        env.update(
            DJANGO_SETTINGS_MODULE=SETTINGS_MODULE,
            DATABASE_URL=via_port(scratch, proxy.port),
            ARTIFACT_ROOT=str(artifacts),
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
            PYTHONUNBUFFERED="1",
            Q_LOG_LEVEL="INFO",
            LOG_LEVEL="INFO",
            LOG_FORMAT="json",  # the checker reads the transition lines (checker.attempt_slots)
            JOBS_LEASE_SECONDS=f"{cfg.lease:g}",
            SOAK_EFFECT_LEASE_SECONDS=f"{cfg.effect_lease:g}",
            JOBS_TENANT_CONCURRENCY=str(cfg.tenant_concurrency),
            SOAK_Q_WORKERS=str(cfg.workers),
            NOTICE_PROVIDER_TOKEN=token,
            NOTICE_PROVIDER_READ_TIMEOUT=f"{cfg.read_timeout:g}",
            NOTICE_PROVIDER_CONNECT_TIMEOUT=f"{cfg.connect_timeout:g}",
            NOTICE_PROVIDER_MAX_IN_FLIGHT=str(cfg.provider_in_flight),
            FAKE_PROVIDER_TOKEN=token,  # the stand-in reads it; never on a command line
        )
        fleet = Fleet(env, logs)
        migrate = subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "migrate", "--noinput", "-v0"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if migrate.returncode:
            raise RuntimeError(f"migrating {name} failed:\n{migrate.stderr[-3000:]}")

        provider_args = [
            "fake_provider",
            "--port=0",
            f"--record={record}",
            f"--stall={cfg.stall:g}",
            f"--stall-seconds={cfg.stall_seconds:g}",
            f"--unavailable={cfg.unavailable:g}",
            f"--retry-after={cfg.retry_after:g}",
        ]
        if cfg.seed is not None:
            provider_args.append(f"--seed={cfg.seed}")
        provider = fleet.start("provider", "provider", *provider_args, stdout=subprocess.PIPE)
        line = provider.popen.stdout.readline().decode()
        if "listening on " not in line:
            raise RuntimeError(f"the stand-in provider did not start: {line!r}")
        env["NOTICE_PROVIDER_URL"] = line.split("listening on ", 1)[1].split()[0]

        # This process works on the scratch database too, with the workers' settings;
        # its own log stays quiet (the workers' logs are in the folder).
        os.environ.update({k: env[k] for k in env if k != "PYTHONPATH"})
        os.environ.update(DATABASE_URL=scratch, Q_LOG_LEVEL="WARNING", LOG_LEVEL="WARNING")
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        import django

        django.setup()

        from jobs import flow

        if cfg.provider_rate:
            rate, period = flow.parse_rate(cfg.provider_rate)
            flow.set_rule("provider:webhook", actor="soak", rate=rate, period_seconds=period)
        ruled = [key for key, _ in TENANTS[: max(2, cfg.tenants)]]
        if cfg.ruled_tenant not in ruled:
            cfg.ruled_tenant = ruled[-1]
        if cfg.ruled_tenant_concurrency:
            flow.set_rule(
                f"tenant:{cfg.ruled_tenant}",
                actor="soak",
                concurrency=cfg.ruled_tenant_concurrency,
            )
        from django.conf import settings as dj_settings

        _say(
            "broker: "
            + (dj_settings.Q_CLUSTER.get("broker_class") or "django-q2's ORM broker")
            + f" (poll {dj_settings.Q_CLUSTER.get('poll')} s)"
        )
        _say(
            f"flow rules: provider:webhook rate {cfg.provider_rate or 'none'}, "
            f"tenant:{cfg.ruled_tenant} concurrency {cfg.ruled_tenant_concurrency or 'default'}"
        )

        world, plan = seed(cfg, rng)
        while plan and plan[0].due <= 0:
            perform(plan.pop(0), world, rng)
        _say(
            f"seeded {len(world.permits)} permit requests in {cfg.tenants} offices; "
            f"{len(world.expects)} jobs queued before the workers start, {len(plan)} actions "
            f"over {cfg.arrival:.0f} s"
        )

        watcher = Watcher(cfg.watch_period)
        watcher.start()
        dispatcher = fleet.start_dispatcher()
        # The clock starts once the dispatcher sweeps: an early outage must find it running
        # (a slow start under load would otherwise begin after the outage ended).
        _wait_for_log(dispatcher, "jobs_dispatcher: sweeping every", timeout=90)
        from tests.chaos import soak_kinds

        tick_start = tick_marks()
        waited = time.monotonic() + 10
        while set(tick_start) != set(soak_kinds.PERIODIC) and time.monotonic() < waited:
            time.sleep(0.1)
            tick_start = tick_marks()
        tick_end = dict(tick_start)
        _say(
            "periodic kinds start after "
            + ", ".join(f"{k} {v:%H:%M:%S}" for k, v in sorted(tick_start.items()))
        )
        for n in range(cfg.clusters):
            fleet.start_cluster(f"qcluster-{'abcdefgh'[n]}")
        t0 = time.monotonic()
        setup_seconds = t0 - started
        deadline = t0 + cfg.timeout
        kills: list[Kill] = []
        paused: dict[int, float] = {}
        next_kill = t0 + cfg.chaos_interval * rng.uniform(0.5, 1.5)
        fault, due_since = next_fault(cfg, rng), None
        next_report = t0 + 5
        chaos_seconds = None  # the kills stop once every request is made and every job ended
        done = False
        while time.monotonic() < deadline:
            elapsed = time.monotonic() - t0
            for said in outages.tick(elapsed):
                _say(f"  {elapsed:5.0f}s {said}")
            while plan and plan[0].due <= elapsed:
                perform(plan.pop(0), world, rng)
            resume_due(paused)
            if chaos_seconds is None and time.monotonic() >= next_kill:
                due_since = due_since or time.monotonic()
                # Wait up to 1.5 s for a worker in the middle of a job or a send.
                patient = time.monotonic() - due_since < 1.5
                kill = chaos_once(fleet, cfg, rng, fault, patient=patient, paused=paused)
                if kill is not None or not patient:
                    if kill is not None:
                        kills.append(kill)
                    next_kill = time.monotonic() + cfg.chaos_interval * rng.uniform(0.5, 1.5)
                    fault, due_since = next_fault(cfg, rng), None
            for what in fleet.supervise(cfg.workers):
                _say(f"  restarted {what}")
            report_due = time.monotonic() >= next_report
            if not plan and report_due:
                # The operator's part: a report that failed or died holds its permit's
                # sequence (docs/app/sequences.md); released, the next revision goes on.
                released = release_sequence_holders()
                if released:
                    _say(f"  released {released} report(s) holding their permit's sequence")
            if not plan or report_due:
                marks = tick_marks()  # before progress: every tick up to it was in its count
                jobs_done, effects_done, status = progress()
                tick_end = marks
                if report_due:
                    next_report += 5
                    _say(f"  {elapsed:5.0f}s kills={len(kills)} {status}")
                if not plan and jobs_done and chaos_seconds is None and not outages.pending:
                    chaos_seconds = elapsed
                    resume_due(paused, everyone=True)
                    _say(
                        f"every job ended after {elapsed:.0f} s and {len(kills)} kills; "
                        "the chaos stops, the notices settle"
                    )
                if not plan and jobs_done and effects_done and not outages.pending:
                    done = True
                    break
            time.sleep(0.1)
        resume_due(paused, everyone=True)
        outages.end_all()
        settle_seconds = time.monotonic() - t0
        if chaos_seconds is None:
            chaos_seconds = settle_seconds
        _say(
            f"after {settle_seconds:.0f} s: "
            + ("every job terminal, every effect final" if done else "DEADLINE REACHED")
        )

        # No more kills: redelivered messages of killed workers come back after
        # Q_CLUSTER['retry'] and are acknowledged as duplicate deliveries.
        drain_started = time.monotonic()
        drain_deadline = drain_started + cfg.drain_timeout
        left = queue_left()
        while left and time.monotonic() < drain_deadline:
            fleet.supervise(cfg.workers)
            time.sleep(0.5)
            left = queue_left()
        drain_seconds = time.monotonic() - drain_started
        drained = "drained" if not left else f"NOT drained ({left} messages left)"
        _say(f"queue {drained} after {drain_seconds:.0f} s")
        watcher.stop()
        fleet.stop_all()
        fleet.stop_provider()

        from django.db import connections

        connections.close_all()
        from tests.chaos import checker, flow_checks

        inputs = checker.Inputs(
            cfg=cfg,
            world=world,
            watcher=watcher,
            kills=kills,
            record=record,
            logs=logs,
            artifact_root=artifacts,
            queue_left=left,
            settled=done,
            unexpected_exits=list(fleet.unexpected),
            restarts=fleet.restarts(),
            outages=list(outages.plan),
            chaos_seconds=chaos_seconds,
            tick_window={k: (tick_start.get(k), tick_end.get(k)) for k in soak_kinds.PERIODIC},
        )
        report = checker.check(inputs)
        flow_checks.check_flow(inputs, report)
        report.figures["wall_seconds"] = round(time.monotonic() - started, 1)
        report.figures["phases_seconds"] = {
            "setup": round(setup_seconds, 1),
            "chaos": round(chaos_seconds, 1),
            "settle": round(settle_seconds - chaos_seconds, 1),
            "drain": round(drain_seconds, 1),
        }
        report.figures["database"] = name
        for line in report.lines():
            _say(line)
        if cfg.json_path:
            Path(cfg.json_path).write_text(json.dumps(report.as_dict(), indent=2, default=str))
        passed = report.passed
        return 0 if passed else 1
    finally:
        if watcher is not None and watcher.is_alive():
            watcher.stop()
        if fleet is not None:
            fleet.stop_all()
            fleet.stop_provider()
        proxy.close()
        disk.unmount()
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        if created and not cfg.keep:
            drop_database(url, name)
        if cfg.keep or not passed:
            _say(f"kept {work}" + (f" and database {name}" if cfg.keep else ""))
        else:
            shutil.rmtree(work, ignore_errors=True)


def parse(argv: list[str] | None = None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(
        prog="python -m tests.chaos.soak",
        description="Crash-and-fault soak against real qcluster workers (PostgreSQL only).",
    )
    p.add_argument("--jobs", type=int, default=d.jobs, help="report jobs (K)")
    p.add_argument("--tenants", type=int, default=d.tenants, choices=range(2, len(TENANTS) + 1))
    p.add_argument("--clusters", type=int, default=d.clusters)
    p.add_argument("--workers", type=int, default=d.workers, help="workers per cluster")
    p.add_argument("--tenant-concurrency", type=int, default=d.tenant_concurrency)
    p.add_argument("--provider-in-flight", type=int, default=d.provider_in_flight)
    p.add_argument("--deadlock-fraction", type=float, default=d.deadlock_fraction)
    p.add_argument("--summary-fraction", type=float, default=d.summary_fraction)
    p.add_argument(
        "--chain-fraction",
        type=float,
        default=d.chain_fraction,
        help="soak.chain jobs per report job (each a group of 2-3 parts and a join)",
    )
    p.add_argument("--stall", type=float, default=d.stall, help="fraction of sends stalled")
    p.add_argument("--unavailable", type=float, default=d.unavailable, help="fraction of 503s")
    p.add_argument(
        "--chaos-interval", type=float, default=d.chaos_interval, help="mean seconds per kill"
    )
    p.add_argument(
        "--pause-fraction",
        type=float,
        default=d.pause_fraction,
        help="fraction of chaos events that SIGSTOP a busy worker past its lease instead",
    )
    p.add_argument(
        "--db-outage",
        type=float,
        default=d.db_outage_seconds,
        help="seconds the database is away once mid-run (connections refused and cut); 0: none",
    )
    p.add_argument(
        "--db-outage-at",
        type=float,
        default=None,
        help="seconds after the workers start (default: 40%% into the arrival window)",
    )
    p.add_argument(
        "--storage-outage",
        type=float,
        default=d.storage_outage_seconds,
        help="seconds the artifact storage is full once mid-run (a real full tmpfs); 0: none",
    )
    p.add_argument(
        "--storage-outage-at",
        type=float,
        default=None,
        help="seconds after the workers start (default: 70%% into the arrival window)",
    )
    p.add_argument("--arrival-seconds", type=float, default=None, help="spread of late requests")
    p.add_argument("--timeout", type=float, default=d.timeout, help="deadline for the chaos phase")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout)
    p.add_argument(
        "--provider-rate", default=d.provider_rate, help="provider:webhook rate rule (or off)"
    )
    p.add_argument("--ruled-tenant-concurrency", type=int, default=d.ruled_tenant_concurrency)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", action="store_true", help="keep the scratch database and folder")
    p.add_argument("--json", default=None, help="also write the figures and checks here")
    a = p.parse_args(argv)
    if a.jobs < 10:
        p.error("--jobs must be at least 10")
    return Config(
        jobs=a.jobs,
        tenants=a.tenants,
        clusters=a.clusters,
        workers=a.workers,
        tenant_concurrency=a.tenant_concurrency,
        provider_in_flight=a.provider_in_flight,
        deadlock_fraction=a.deadlock_fraction,
        summary_fraction=a.summary_fraction,
        chain_fraction=a.chain_fraction,
        stall=a.stall,
        unavailable=a.unavailable,
        chaos_interval=a.chaos_interval,
        pause_fraction=a.pause_fraction,
        db_outage_seconds=a.db_outage,
        db_outage_at=a.db_outage_at,
        storage_outage_seconds=a.storage_outage,
        storage_outage_at=a.storage_outage_at,
        arrival_seconds=a.arrival_seconds,
        timeout=a.timeout,
        drain_timeout=a.drain_timeout,
        seed=a.seed,
        keep=a.keep,
        json_path=a.json,
        provider_rate=None if a.provider_rate in ("", "off", "none") else a.provider_rate,
        ruled_tenant_concurrency=a.ruled_tenant_concurrency,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    try:
        server_url()
    except Refused as exc:
        print(f"soak: refusing to run: {exc}", file=sys.stderr)
        return 2
    # A SIGTERM (CI timeout, a parent giving up) still drops the scratch database.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import psycopg

    try:
        return run(cfg)
    except (RuntimeError, OSError, psycopg.Error) as exc:  # setup failed: no verdict
        print(f"soak: could not run: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
