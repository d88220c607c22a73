"""The failover drill: ``python -m tests.chaos.failover`` (``make failover-drill``), issue 47.

Per mode, a PostgreSQL primary and a streaming standby of the drill's own on loopback
(``tests.chaos.pgcluster``: initdb, pg_basebackup, pg_ctl promote), the stand-in
provider, moto's S3 server and three worker hosts (``manage.py jobs_worker`` each, its own
``JOBS_HOST_NAME``; host-a also runs ``jobs_dispatcher``, the maintenance loop that
watches the timeline). Every process reaches the database through one libpq multi-host
URL (``target_session_attrs=read-write``), so nobody is re-pointed: after the promotion
the old address refuses and the standby's accepts writes.

- ``sync``: ``synchronous_standby_names`` names the standby, ``synchronous_commit=on``.
  Permit requests enter review one after another (each asks for its report); once a
  third of the reports ended, the primary is stopped ``-m immediate`` under load and
  the standby promoted. Promises: no acknowledged job lost, no identity reused, no
  duplicate notice, no orphan object, every job and effect settled.
- ``async``: no synchronous standby; once a third ended the standby is cut off its
  primary (it keeps what it has, receives nothing more: a replica held behind), the
  load goes on until more reports were published and notified, then the primary
  crashes and the standby is promoted. ``manage.py jobs_reconcile --json`` runs at once;
  promises: no identity reused, every lost job the outside world has something of is
  listed and asked for again (its subject exists), every key the provider accepted for
  a lost effect is listed, and no second notice goes out for such a key.

After the workers stop, the old primary is started on its own (``127.0.0.3``) as the
record of what it had. Each mode runs in a child process of its own (``--mode``,
Django set up once per database) and prints one JSON line; the parent prints the last
line: ``failover-drill: PASS sync lost=0 reused=0 duplicates=0 orphans=0; async reused=0
reconciled=N/M second-sends=0`` or ``FAIL`` with the same fields (exit 1; 2 when the
drill could not run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jobs.testing.processes import Processes
from tests.chaos import pgcluster
from tests.chaos.failover_checks import Verdict
from tests.chaos.scaleout import SETTINGS_MODULE, Host, wait_for_clusters

ROOT = Path(__file__).resolve().parents[2]
RESULT = "failover-result "  # a child's JSON line starts with this
LOOP_LINE = re.compile(r"reconciled after a failover: .* unknown_keys=(\d+)")


@dataclass
class Config:
    jobs: int = 45  # permit requests per mode
    hosts: int = 3
    workers: int = 2  # django-q2 workers per host
    crash_after: float = 1 / 3  # of the reports ended
    lost_at_least: int = 4  # async: reports published while held behind, before the crash
    timeout: float = 240.0  # per mode, from the first request
    keep: bool = False


def _say(line: str) -> None:
    print(line, flush=True)


def _environment(url: str, s3_env: dict, token: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TEST_DATABASE_NAME", "DJANGO_SETTINGS_MODULE", "ARTIFACT_ROOT")
    }
    env.update(
        s3_env,
        DJANGO_SETTINGS_MODULE=SETTINGS_MODULE,
        DATABASE_URL=url,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        PYTHONUNBUFFERED="1",
        Q_LOG_LEVEL="INFO",
        LOG_LEVEL="INFO",
        JOBS_TENANT_CONCURRENCY="4",
        SOAK_Q_WORKERS="2",
        NOTICE_PROVIDER_TOKEN=token,
        NOTICE_PROVIDER_MAX_IN_FLIGHT="2",
        NOTICE_PROVIDER_CONNECT_TIMEOUT="1",
        NOTICE_PROVIDER_READ_TIMEOUT="1",
        SOAK_EFFECT_LEASE_SECONDS="4",
        FAKE_PROVIDER_TOKEN=token,
    )
    return env


def _manage(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Load:
    """Permit requests entering review one after another (each asks for its report), from
    a thread; a request counts as acknowledged when its commit returned. A failed one
    (the primary went away) is asked again until it returns: it is idempotent."""

    def __init__(self, permit_ids: list[int], pause: float):
        self.permit_ids, self.pause = permit_ids, pause
        self.acknowledged: dict[int, str] = {}  # permit id -> job uid
        self.failed_calls = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="load", daemon=True)

    def _run(self) -> None:
        from django.db import connection

        from permits.models import PermitRequest
        from permits.services import enter_review

        for pk in self.permit_ids:
            while not self.stop.is_set():
                try:
                    job, _ = enter_review(PermitRequest.objects.get(pk=pk))
                    self.acknowledged[pk] = str(job.uid)
                    break
                except Exception:  # the primary went away: not acknowledged, ask again
                    self.failed_calls += 1
                    with contextlib.suppress(Exception):
                        connection.close()
                    time.sleep(0.5)
            time.sleep(self.pause)
        connection.close()


def seed(n: int) -> list[int]:
    """Tenants, a reviewer each, ``n`` submitted permit requests (no report asked yet)."""
    from decimal import Decimal

    from django.contrib.auth import get_user_model

    from permits.models import PermitRequest, Tenant
    from permits.services import assign_reviewer

    tenants = [
        Tenant.objects.get_or_create(key=k, defaults={"name": k.title()})[0]
        for k in ("springfield", "shelbyville", "ogdenville")
    ]
    reviewers = {
        t.key: get_user_model().objects.create_user(username=f"fo-{t.key}", password=None)
        for t in tenants
    }
    ids = []
    for i in range(n):
        tenant = tenants[i % len(tenants)]
        permit = PermitRequest.objects.create(
            tenant=tenant,
            reference=f"FAILOVER-{i:05d}",
            site_address=f"{100 + i} Failover Street",
            parcel=f"FO-{i:05d}",
            work_type=PermitRequest.WorkType.values[i % len(PermitRequest.WorkType.values)],
            description="Plans and specifications as submitted with the application.",
            valuation=Decimal(10_000 + i),
            status=PermitRequest.Status.SUBMITTED,
            applicant_name=f"Applicant {i}",
            applicant_phone=f"+1 555 {i:05d}",
            applicant_email=f"applicant{i}@example.org",
            applicant_id_number=f"ID-{i:05d}",
        )
        assign_reviewer(permit, reviewers[tenant.key])
        ids.append(permit.pk)
    return ids


def _retrying(fn, *, timeout: float = 60.0):
    """``fn()`` through an outage of the database (the failover), or the last error."""
    from django.db import connections

    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except Exception:
            if time.monotonic() > deadline:
                raise
            connections.close_all()
            time.sleep(0.5)


def ended_reports() -> tuple[int, int, int, int]:
    """(jobs ended, jobs, effects final, effects) on the server taking writes."""
    from jobs.models import Effect, Job

    return (
        Job.objects.filter(state__in=Job.TERMINAL).count(),
        Job.objects.count(),
        Effect.objects.filter(state__in=Effect.FINAL).count(),
        Effect.objects.count(),
    )


@dataclass
class Drill:
    """One mode's moving parts."""

    mode: str
    cfg: Config
    folder: Path
    primary: pgcluster.Server
    standby: pgcluster.Server
    env: dict
    procs: Processes
    record: Path
    s3: object
    bucket: str
    crashed_at: float = 0.0  # wall clock
    promoted_at: float = 0.0
    report: dict | None = None
    kept_uids: set | None = None  # the standby's jobs at the crash


def _start_hosts(d: Drill) -> list[Host]:
    hosts = []
    for n in range(d.cfg.hosts):
        name = f"host-{'abc'[n]}"
        host = Host(name, d.folder / name)
        (host.folder / "tmp").mkdir(parents=True)
        host_env = {**d.env, "JOBS_HOST_NAME": name, "TMPDIR": str(host.folder / "tmp")}
        host.worker = d.procs.start(
            f"{name}.worker", "jobs_worker", "--stop-timeout=5", "--stall-seconds=25", env=host_env
        )
        if n == 0:  # the maintenance loop, fine-grained: it notices the new timeline
            host.dispatcher = d.procs.start(
                f"{name}.dispatcher", "jobs_dispatcher", "--interval", "1", env=host_env
            )
        hosts.append(host)
    return hosts


def _fail_over(d: Drill, load: Load, t0: float) -> None:
    """Wait for a third of the reports (async: hold the standby behind, wait for more
    notices), crash the primary, promote the standby; async: jobs_reconcile at once."""
    from jobs.testing.fakeprovider import Record

    crash_at = max(2, int(d.cfg.jobs * d.cfg.crash_after))
    while _retrying(ended_reports)[0] < crash_at:
        _check_time(t0, d.cfg, "a third of the reports")
        time.sleep(0.3)
    if d.mode == "async":
        pgcluster.hold_behind(d.primary, d.standby)
        before = set(load.acknowledged.values())
        _say(f"  {time.monotonic() - t0:5.0f}s standby held behind ({len(before)} asked so far)")
        while True:  # until reports asked for since are published and notified
            after = set(load.acknowledged.values()) - before
            sent = {s["effect_id"].split(":", 1)[0] for s in Record(d.record).sends()}
            if len(after & sent) >= d.cfg.lost_at_least:
                break
            _check_time(t0, d.cfg, "notices while held behind")
            time.sleep(0.2)
    ended = _retrying(ended_reports)[0]
    d.crashed_at = time.time()
    d.primary.crash()
    _say(f"  {time.monotonic() - t0:5.0f}s primary crashed (-m immediate), {ended} reports ended")
    # What the promoted server starts with, read while it is still a (hot) standby: the
    # jobs missing here are what the failover lost, whoever asks for them again later.
    d.kept_uids = {r[0] for r in d.standby.query("SELECT uid::text FROM jobs_job")}
    d.standby.promote()
    d.standby.wait_ready(writable=True)
    d.promoted_at = time.time()
    _say(
        f"  {time.monotonic() - t0:5.0f}s standby promoted (timeline "
        f"{_retrying(lambda: pgcluster.timeline(d.standby))}), "
        f"{d.promoted_at - d.crashed_at:.1f}s after the crash"
    )
    if d.mode == "async":
        done = _manage(d.env, "jobs_reconcile", "--json")
        if done.returncode:
            raise RuntimeError(f"jobs_reconcile failed: {done.stderr[-2000:]}")
        d.report = json.loads(done.stdout)
        _say(
            f"  {time.monotonic() - t0:5.0f}s jobs_reconcile: {len(d.report['lost_jobs'])} lost, "
            f"{d.report['asked_again']} asked again, {len(d.report['unknown_keys'])} accepted "
            f"keys not in the ledger, {d.report['marked']} marked"
        )


def _check_time(t0: float, cfg: Config, what: str) -> None:
    if time.monotonic() - t0 > cfg.timeout:
        raise RuntimeError(f"timed out waiting for {what}")


def _settle(d: Drill, load: Load, t0: float) -> bool:
    """Wait until every permit was asked for and every job and effect ended."""
    next_report = time.monotonic() + 10
    while time.monotonic() - t0 < d.cfg.timeout:
        ended, jobs, final, effects = _retrying(ended_reports)
        if not load.thread.is_alive() and ended == jobs and final == effects:
            return True
        if time.monotonic() >= next_report:
            next_report += 10
            _say(
                f"  {time.monotonic() - t0:5.0f}s jobs {ended}/{jobs} ended, "
                f"effects {final}/{effects}"
            )
        if d.procs.dead():
            _say(f"  exited unexpectedly: {d.procs.dead()}")
            return False
        time.sleep(0.5)
    return False


def _watched(d: Drill, timeout: float = 45.0) -> str:
    """Whether the maintenance loop noticed the promotion: its mark (``ReconcileMark``)
    moved to the promoted server's timeline (it looks every few seconds)."""
    deadline = time.monotonic() + timeout
    current = pgcluster.timeline(d.standby)
    while time.monotonic() < deadline:
        rows = d.standby.query("SELECT timeline, updated_at FROM jobs_reconcilemark")
        if rows and rows[0][0] == current:
            after = rows[0][1].timestamp() - d.promoted_at
            return f"reconciled timeline {current} {after:.0f}s after the promotion"
        time.sleep(0.5)
    return f"mark {rows[0][0] if rows else None}, server on timeline {current}"


def run_mode(mode: str, cfg: Config) -> dict:
    """One mode, start to verdict; returns its figures and failures."""
    import secrets

    from jobs.testing.s3server import moto_server_process

    folder = pgcluster.workdir(f"failover-{mode}-")
    logs = folder / "logs"
    logs.mkdir()
    servers: list[pgcluster.Server] = []
    procs = None
    try:
        with moto_server_process(logs / "s3.log") as s3:
            primary, standby = pgcluster.make_pair(folder, synchronous=mode == "sync")
            servers += [primary, standby]
            url = (
                f"postgres://{pgcluster.ROLE}@{primary.host},{standby.host}:{primary.port}/"
                f"{pgcluster.DATABASE}?target_session_attrs=read-write&connect_timeout=2"
            )
            bucket = s3.create_bucket(f"failover-{mode}")
            env = _environment(url, s3.environment(bucket), secrets.token_urlsafe(16))
            procs = Processes(
                env, logs, command=(sys.executable, str(ROOT / "manage.py")), cwd=ROOT
            )
            d = Drill(
                mode,
                cfg,
                folder,
                primary,
                standby,
                env,
                procs,
                logs / "provider.sqlite3",
                s3,
                bucket,
            )
            return _drive(d, servers)
    finally:
        if procs is not None:
            procs.stop_all()
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        if cfg.keep:
            _say(f"  kept {folder}")
            for server in servers:
                server.crash()
        else:
            pgcluster.remove(folder, servers)


def _drive(d: Drill, servers: list[pgcluster.Server]) -> dict:
    migrate = _manage(d.env, "migrate", "--noinput", "-v0")
    if migrate.returncode:
        raise RuntimeError(f"migrate failed: {migrate.stderr[-3000:]}")
    provider = d.procs.start(
        "provider", "fake_provider", "--port=0", f"--record={d.record}", stdout=subprocess.PIPE
    )
    line = provider.popen.stdout.readline().decode()
    if "listening on " not in line:
        raise RuntimeError(f"the stand-in provider did not start: {line!r}")
    d.env["NOTICE_PROVIDER_URL"] = line.split("listening on ", 1)[1].split()[0]
    os.environ.update({k: v for k, v in d.env.items() if k != "PYTHONPATH"})
    os.environ.update(Q_LOG_LEVEL="WARNING", LOG_LEVEL="WARNING")
    import django

    django.setup()
    permit_ids = seed(d.cfg.jobs)
    pgcluster.caught_up(d.primary, d.standby)  # the subjects are on both
    hosts = _start_hosts(d)
    booted = wait_for_clusters(hosts, timeout=120)
    _say(f"  every host's cluster running after {booted:.0f} s")
    load = Load(permit_ids, pause=0.3)
    t0 = time.monotonic()
    load.thread.start()
    _fail_over(d, load, t0)
    settled = _settle(d, load, t0)
    settle = time.monotonic() - t0
    watched = _watched(d)
    load.stop.set()
    dead = d.procs.dead()
    d.procs.stop_all()
    from django.db import connections

    connections.close_all()
    old = pgcluster.Server("old-primary", d.primary.data, "127.0.0.3", d.primary.port)
    old.start("-c synchronous_standby_names=''")
    servers.append(old)
    old.wait_ready(writable=True)
    v = verify(d, old, load)
    v.check(settled, f"not settled after {settle:.0f} s")
    v.check(not dead, f"processes exited unexpectedly: {dead}")
    v.figures["settle_s"] = round(settle)
    v.figures["watch"] = watched
    v.check(watched.startswith("reconciled"), f"the maintenance loop: {watched}")
    v.figures["failed_requests"] = load.failed_calls
    return {"mode": d.mode, "figures": v.figures, "failures": v.failures}


def verify(d: Drill, old: pgcluster.Server, load: Load) -> Verdict:
    """Every promise of the mode, from the servers, the bucket and the provider's record."""
    from jobs.testing.fakeprovider import Record
    from tests.chaos import failover_checks as fc

    v = Verdict()
    new_rows, old_rows = fc.read_rows(d.standby), fc.read_rows(old)
    record = Record(d.record)
    sends, posts = record.sends(), record.requests()
    client = d.s3.client()
    objects = {
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=d.bucket, Prefix="jobs/"
        )
        for o in page.get("Contents", [])
    }
    sent_uids = {s["effect_id"].split(":", 1)[0] for s in sends}
    reused = fc.reused_identities(old_rows, new_rows, posts)
    v.figures["reused"] = len(reused)
    v.check(not reused, f"identities reused: {reused[:5]}")
    v.figures["row_ids_repeated"] = fc.repeated_row_ids(old_rows, new_rows)
    duplicates = fc.duplicate_notices(sends, [new_rows, old_rows])
    pending = fc.unsettled(new_rows)
    v.check(not pending, f"not settled: {pending[:5]}")
    v.figures["jobs"] = len(new_rows.jobs)
    v.figures["notices"] = len(sends)
    if d.mode == "sync":
        lost = fc.lost_acknowledged(set(load.acknowledged.values()), sent_uids, new_rows)
        orphans = fc.orphans(objects, new_rows)
        v.figures.update(lost=len(lost), duplicates=duplicates, orphans=len(orphans))
        v.check(not lost, f"acknowledged jobs lost: {sorted(lost)[:5]}")
        v.check(not duplicates, f"{duplicates} duplicate notices")
        v.check(not orphans, f"orphan objects: {orphans[:5]}")
        return v
    _verify_async(v, d, old_rows, new_rows, objects, sends, posts, duplicates)
    return v


def _verify_async(v, d, old_rows, new_rows, objects, sends, posts, duplicates) -> None:
    from tests.chaos import failover_checks as fc

    lost = set(old_rows.jobs) - (d.kept_uids or set())
    traced = fc.with_evidence(lost, objects, sends)
    report = d.report or {"lost_jobs": [], "unknown_keys": []}
    # Asked again by jobs_reconcile run here or by the maintenance loop's (each notes it in
    # the job's history), whichever came first; the other finds it there.
    by_either = {
        r[0]
        for r in d.standby.query(
            "SELECT j.uid::text FROM jobs_jobevent e JOIN jobs_job j ON j.id = e.job_id"
            " WHERE e.action = 'reconcile' AND e.note LIKE 'asked again%%'"
        )
    }
    listed = {j["job"] for j in report["lost_jobs"]} | by_either
    asked = {j["job"] for j in report["lost_jobs"] if j["outcome"] == "asked_again"}
    v.figures["asked_by"] = {"jobs_reconcile": len(asked), "either": len(by_either)}
    asked |= by_either
    reconciled = {
        u
        for u in traced
        if u in new_rows.jobs and new_rows.jobs[u][5] == "succeeded" and u in asked
    }
    # Keys the provider had accepted for lost effects when the standby was promoted (a lost
    # job asked again may send, once, a notice the provider never had: not one of these).
    lost_keys = {
        s["idempotency_key"]
        for s in sends
        if s["effect_id"].split(":", 1)[0] in lost and s["applied_at"] < d.promoted_at
    }
    listed_keys = {u["idempotency_key"] for u in report["unknown_keys"]}
    # The maintenance loop's reconcile, when it came first, logs what it found.
    loop_log = d.folder / "logs" / "host-a.dispatcher.log"
    found = LOOP_LINE.findall(loop_log.read_text(errors="replace")) if loop_log.exists() else []
    loop_keys = max((int(n) for n in found), default=0)
    ref_of = {s["idempotency_key"]: s["send_id"] for s in sends}
    recorded = {
        row[0]
        for row in new_rows.effects.values()
        if row[0] in lost_keys and row[2] == "applied" and row[4] == ref_of.get(row[0])
    }
    second, replays = fc.second_sends(sends, posts, before=d.crashed_at)
    v.figures.update(
        lost_rows=len(lost),
        untraced=len(lost - traced),
        reconciled=f"{len(reconciled)}/{len(traced)}",
        lost_keys=len(lost_keys),
        second_sends=second + duplicates,
        replays=replays,
    )
    v.check(bool(traced), "the replica held behind lost nothing the outside world has")
    v.check(traced <= listed, f"lost jobs not listed: {sorted(traced - listed)[:5]}")
    v.check(reconciled == traced, f"lost jobs not asked again: {sorted(traced - reconciled)[:5]}")
    v.figures["lost_keys_listed"] = {
        "jobs_reconcile": len(lost_keys & listed_keys),
        "loop": loop_keys,
    }
    v.figures["lost_keys_recorded"] = len(recorded)
    v.check(
        lost_keys <= listed_keys or loop_keys >= len(lost_keys),
        f"{len(lost_keys - listed_keys)} accepted keys not listed",
    )
    v.check(recorded == lost_keys, f"{len(lost_keys - recorded)} accepted keys not recorded")
    v.check(second + duplicates == 0, f"{second} second sends, {duplicates} duplicate notices")


def summary(results: dict[str, dict]) -> str:
    sync = results.get("sync", {}).get("figures", {})
    asy = results.get("async", {}).get("figures", {})
    ok = all(r.get("failures") == [] for r in results.values()) and len(results) == 2
    return (
        f"failover-drill: {'PASS' if ok else 'FAIL'} sync lost={sync.get('lost', '?')} "
        f"reused={sync.get('reused', '?')} duplicates={sync.get('duplicates', '?')} "
        f"orphans={sync.get('orphans', '?')}; async reused={asy.get('reused', '?')} "
        f"reconciled={asy.get('reconciled', '?')} second-sends={asy.get('second_sends', '?')}"
    )


def child(mode: str, cfg: Config) -> int:
    _say(f"failover-drill {mode}: {cfg.jobs} permit requests, {cfg.hosts} hosts")
    try:
        result = run_mode(mode, cfg)
    except Exception as exc:
        result = {
            "mode": mode,
            "figures": {},
            "failures": [f"could not run: {type(exc).__name__}: {exc}"],
        }
    for failure in result["failures"]:
        _say(f"  check failed: {failure}")
    _say(f"  figures {json.dumps(result['figures'], sort_keys=True)}")
    _say(RESULT + json.dumps(result))
    return 0 if not result["failures"] else 1


def parent(cfg: Config, argv: list[str]) -> int:
    started = time.monotonic()
    if not (pgcluster.BIN / "initdb").exists():
        _say(f"failover-drill: cannot run: no PostgreSQL server binaries in {pgcluster.BIN}")
        return 2
    results: dict[str, dict] = {}
    for mode in ("sync", "async"):
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "tests.chaos.failover", "--mode", mode, *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for out in done.stdout.splitlines():
            if out.startswith(RESULT):
                results[mode] = json.loads(out[len(RESULT) :])
            else:
                _say(out)
        _say(f"  {mode}: {time.monotonic() - began:.0f}s")
    _say(f"  wall {time.monotonic() - started:.0f}s")
    line = summary(results)
    _say(line)
    if len(results) < 2:
        return 2
    return 0 if line.startswith("failover-drill: PASS") else 1


def parse(argv: list[str] | None = None) -> tuple[Config, str | None, list[str]]:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=d.jobs)
    p.add_argument("--timeout", type=float, default=d.timeout)
    p.add_argument("--keep", action="store_true", help="keep the servers' folder")
    p.add_argument("--mode", choices=("sync", "async"), help="run one mode (the child)")
    args = p.parse_args(argv)
    passed = [f"--jobs={args.jobs}", f"--timeout={args.timeout}"] + (
        ["--keep"] if args.keep else []
    )
    return Config(jobs=args.jobs, timeout=args.timeout, keep=args.keep), args.mode, passed


def main(argv: list[str] | None = None) -> int:
    cfg, mode, passed = parse(argv)
    if mode:
        return child(mode, cfg)
    return parent(cfg, passed)


if __name__ == "__main__":
    sys.exit(main())
