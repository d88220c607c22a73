"""The multi-host drill: ``python -m tests.chaos.scaleout --jobs 300`` (``make scaleout``).

Three "hosts" on one machine share what real hosts share and nothing else: one
PostgreSQL database, one S3-compatible bucket (moto's server on loopback, over HTTP)
and the stand-in notice provider. Each host is its own process trees — a
``manage.py jobs_worker`` (which runs its qcluster) and a ``manage.py
jobs_dispatcher`` — with its own host name (``JOBS_HOST_NAME``, so worker
identities differ) and its own scratch folder (``TMPDIR``: the supervisor's
progress file, the verified reads' spools). Every dispatcher runs at once: there is
no leader.

Once every host's qcluster runs, K ``permits.report`` jobs are requested (each
publishes an in-app notice and a webhook notice per reviewer); once a third of them
ended, one host's whole process trees are SIGKILLed while it holds work, and not
restarted. The others take over
its expired leases and its messages.

The verdict reads the database, the bucket and the provider's own record, never
the engine's counters:

- every job ended and succeeded; one artifact row per job and per stable key;
- per succeeded job, one object in the bucket under the row's name whose bytes
  hash to the row's sha256 (objects named by no row are a stale worker's orphans:
  counted, allowed);
- every effect final; one in-app notice row per in-app effect; the provider
  applied each webhook effect once (duplicate effects: 0) and every applied row
  names the provider's id; the most calls it held open at once stays within the
  bound (``NOTICE_PROVIDER_MAX_IN_FLIGHT``, advisory-lock slots shared by all hosts);
- every host claimed work, the killed host none after its kill, and no process
  exited unexpectedly.

The last line is ``scaleout: PASS ...`` or ``scaleout: FAIL ...``; exit 1 on FAIL,
2 when the drill could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from jobs.testing import scratchdb
from jobs.testing.processes import Proc, Processes
from jobs.testing.s3server import honours_conditional_create, moto_server_process

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_MODULE = "tests.chaos.scaleout_settings"
TENANTS = [
    ("springfield", "Springfield Permit Office"),
    ("shelbyville", "Shelbyville Building Department"),
    ("ogdenville", "Ogdenville Permits"),
    ("north-haverbrook", "North Haverbrook Building Office"),
]


@dataclass
class Config:
    jobs: int = 300
    hosts: int = 3
    workers: int = 2  # django-q2 workers per host
    provider_in_flight: int = 2
    tenant_concurrency: int = 4
    kill_after: float = 1 / 3  # of the jobs ended
    timeout: float = 600.0
    seed: int | None = None
    keep: bool = False


@dataclass
class Host:
    name: str
    folder: Path
    worker: Proc | None = None
    dispatcher: Proc | None = None
    killed_at: float | None = None  # wall clock

    @property
    def procs(self) -> list[Proc]:
        return [p for p in (self.worker, self.dispatcher) if p is not None]


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)


def _say(line: str) -> None:
    print(line, flush=True)


def seed(cfg: Config, rng: random.Random) -> list[int]:
    """Tenants, two reviewers each, K permits; request one report per permit."""
    from decimal import Decimal

    from django.contrib.auth import get_user_model

    from permits.models import PermitRequest, Tenant
    from permits.services import assign_reviewer, report_request

    User = get_user_model()
    tenants, reviewers = [], {}
    for key, name in TENANTS:
        tenant, _ = Tenant.objects.get_or_create(key=key, defaults={"name": name})
        tenants.append(tenant)
        reviewers[key] = [
            User.objects.create_user(username=f"scale-{key}-{n}", password=None) for n in (1, 2)
        ]
    work_types = list(PermitRequest.WorkType.values)
    job_ids = []
    for i in range(cfg.jobs):
        tenant = tenants[i % len(tenants)]
        permit = PermitRequest.objects.create(
            tenant=tenant,
            reference=f"SCALE-{i:05d}",
            site_address=f"{100 + i} Scale Street",
            parcel=f"SC-{i:05d}",
            work_type=rng.choice(work_types),
            description="Plans and specifications as submitted with the application.",
            valuation=Decimal(rng.randrange(2_000, 900_000)),
            status=PermitRequest.Status.IN_REVIEW,
            applicant_name=f"Applicant {i}",
            applicant_phone=f"+1 555 {i:05d}",
            applicant_email=f"applicant{i}@example.org",
            applicant_id_number=f"ID-{i:05d}",
        )
        assign_reviewer(permit, rng.choice(reviewers[tenant.key]))
        job, _ = report_request(permit, revision=1)
        job_ids.append(job.pk)
    return job_ids


def progress() -> tuple[int, int, int, int]:
    """(jobs ended, jobs in all, effects final, effects in all), read from the database."""
    from jobs.models import Effect, Job

    jobs = Job.objects.count()
    ended = Job.objects.filter(state__in=Job.TERMINAL).count()
    effects = Effect.objects.count()
    final = Effect.objects.filter(state__in=Effect.FINAL).count()
    return ended, jobs, final, effects


def host_of(worker: str) -> str:
    return worker.split(":", 1)[0]


def running_on(host: str) -> int:
    from jobs.models import Job

    return Job.objects.filter(state=Job.State.RUNNING, lease_owner__startswith=f"{host}:").count()


def verify(cfg: Config, hosts: list[Host], s3, bucket: str, record_path: Path) -> Verdict:
    """Every check of the drill, from the database, the bucket and the provider's record."""
    from django.db.models import Count

    from jobs.models import Artifact, Attempt, Effect, Job, Notice
    from jobs.testing.fakeprovider import Record

    v = Verdict()
    states = dict(Job.objects.values_list("state").annotate(n=Count("id")).order_by())
    succeeded = states.get(Job.State.SUCCEEDED, 0)
    v.figures["jobs"] = f"{succeeded}/{cfg.jobs} succeeded"
    v.check(sum(states.values()) == cfg.jobs, f"{sum(states.values())} jobs, expected {cfg.jobs}")
    v.check(succeeded == cfg.jobs, f"job states {states}")

    # Artifacts: one row per succeeded job and per key; its object's bytes hash to the row.
    rows = list(Artifact.objects.values_list("job_id", "key", "storage_name", "sha256"))
    per_job = Counter(r[0] for r in rows)
    per_key = Counter(r[1] for r in rows)
    v.check(all(n == 1 for n in per_job.values()), "a job with several artifact rows")
    v.check(all(n == 1 for n in per_key.values()), "a stable key with several artifact rows")
    succeeded_ids = set(Job.objects.filter(state=Job.State.SUCCEEDED).values_list("pk", flat=True))
    v.check(set(per_job) == succeeded_ids, "succeeded jobs and artifact rows differ")
    client = s3.client()
    objects = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="jobs/"):
        for obj in page.get("Contents", []):
            objects[obj["Key"]] = obj["Size"]
    matching = 0
    bad = []
    for _, key, name, sha in rows:
        if name not in objects:
            bad.append(f"{key}: no object")
            continue
        body = client.get_object(Bucket=bucket, Key=name)["Body"].read()
        if hashlib.sha256(body).hexdigest() == sha:
            matching += 1
        else:
            bad.append(f"{key}: checksum differs")
    named = {r[2] for r in rows}
    # Not artifacts: the storage probe's objects and the jobs' identity manifests (issue 47).
    others = ("jobs/.probe/", "jobs/.identity/")
    orphans = [k for k in objects if k not in named and not k.startswith(others)]
    v.figures["artifacts"] = f"{matching}/{len(succeeded_ids)} objects, checksum matching"
    v.figures["orphans"] = len(orphans)
    v.check(not bad and matching == len(succeeded_ids), f"artifacts: {bad[:5]}")

    # Effects: final; in-app once (one Notice row each); the provider applied each once.
    v.figures["effect_states"] = {
        f"{p}:{s}": n
        for p, s, n in Effect.objects.values_list("provider", "state")
        .annotate(n=Count("id"))
        .order_by("provider", "state")
    }
    open_effects = Effect.objects.exclude(state__in=Effect.FINAL).count()
    v.check(open_effects == 0, f"{open_effects} effects not final")
    # No reviewer is revoked and no fault is injected: every notice must be applied.
    not_applied = Effect.objects.exclude(state=Effect.State.APPLIED).count()
    v.check(not_applied == 0, f"{not_applied} effects final but not applied")
    inapp = Effect.objects.filter(provider="inapp")
    notices = Notice.objects.filter(effect__in=inapp).count()
    inapp_applied = inapp.filter(state=Effect.State.APPLIED).count()
    v.check(notices == inapp_applied, f"{notices} notices for {inapp_applied} in-app effects")
    record = Record(record_path)
    duplicates = record.duplicate_effects()
    sent = record.sends_by_effect()
    webhook = dict(
        Effect.objects.filter(provider="webhook").values_list("effect_id", "state").order_by()
    )
    applied = {e for e, s in webhook.items() if s == Effect.State.APPLIED}
    v.check(set(sent) == applied, "provider's sends and applied webhook effects differ")
    v.check(not duplicates, f"effects applied twice: {list(duplicates)[:5]}")
    v.figures["effects"] = f"{inapp_applied} in-app, {len(applied)}/{len(webhook)} webhook applied"
    v.figures["duplicate_effects"] = len(duplicates)
    peak = record.max_in_flight()
    v.figures["provider_peak"] = f"{peak}/{cfg.provider_in_flight}"
    v.check(peak <= cfg.provider_in_flight, f"provider held {peak} calls open at once")

    # Hosts: all claimed work; the killed one nothing after its kill.
    claims = Counter()
    late = 0
    killed = {h.name: h.killed_at for h in hosts if h.killed_at}
    for worker, started in Attempt.objects.values_list("worker", "started_at"):
        host = host_of(worker)
        claims[host] += 1
        if host in killed and started.timestamp() > killed[host] + 1:
            late += 1
    v.figures["claims_by_host"] = dict(sorted(claims.items()))
    v.check(all(claims[h.name] > 0 for h in hosts), f"a host claimed nothing: {dict(claims)}")
    v.check(late == 0, f"{late} attempts by the killed host after its kill")
    victim = next(iter(killed), None)
    attempts = list(Attempt.objects.values_list("job_id", "worker", "outcome"))
    touched = {job for job, w, _ in attempts if host_of(w) == victim}
    finished_elsewhere = {
        job for job, w, o in attempts if o == "succeeded" and host_of(w) != victim
    }
    v.figures["taken_over"] = len(touched & finished_elsewhere)
    v.figures["attempts"] = dict(Counter(o or "open" for _, _, o in attempts).most_common())
    return v


def dispatches(hosts: list[Host]) -> dict[str, dict[str, int]]:
    """What each host's dispatcher says it sent (its log): all of them sweep, no leader."""
    out = {}
    for host in hosts:
        sent: Counter = Counter()
        try:
            text = host.dispatcher.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        for match in re.finditer(
            r"dispatch due_jobs=(\d+) expired_leases=(\d+) effects=(\d+)", text
        ):
            for key, value in zip(("due", "expired", "effects"), match.groups(), strict=True):
                sent[key] += int(value)
        out[host.name] = dict(sent)
    return out


CLUSTER_RUNNING = re.compile(r"Q Cluster \S+ \[\w+\] running")


def wait_for_clusters(hosts: list[Host], *, timeout: float) -> float:
    """Seconds until each host's qcluster said it runs (django-q2's log line)."""
    began = time.monotonic()
    waiting = list(hosts)
    while waiting and time.monotonic() - began < timeout:
        waiting = [
            h
            for h in waiting
            if not CLUSTER_RUNNING.search(h.worker.log_path.read_text(errors="replace"))
        ]
        time.sleep(0.2)
    if waiting:
        raise RuntimeError(f"no running cluster after {timeout:g} s on {[h.name for h in waiting]}")
    return time.monotonic() - began


def run(cfg: Config) -> int:
    try:
        url = scratchdb.server_url(purpose="make scaleout")
    except scratchdb.NotPostgres as exc:
        _say(f"scaleout: cannot run: {exc}")
        return 2
    rng = random.Random(cfg.seed)
    started = time.monotonic()
    name = f"scaleout_{secrets.token_hex(5)}"
    work = ROOT / "var" / "scaleout" / name
    logs = work / "logs"
    logs.mkdir(parents=True)
    record = work / "provider.sqlite3"
    created = passed = False
    verdict = "scaleout: FAIL interrupted"
    procs: Processes | None = None
    stack = contextlib.ExitStack()
    try:
        scratch = scratchdb.create(url, name)
        created = True
        s3 = stack.enter_context(moto_server_process(logs / "s3.log"))
        bucket = s3.create_bucket("reports")
        honoured, status = honours_conditional_create(s3, bucket)
        if not honoured:
            verdict = (
                f"scaleout: FAIL the S3 server answered {status} to a second conditional create"
            )
            return 1
        _say(
            f"scaleout {name}: {cfg.jobs} report jobs on {cfg.hosts} hosts; PostgreSQL "
            f"{name}, S3 {s3.endpoint}/{bucket} (412 on a second conditional create)"
        )
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TEST_DATABASE_NAME", "DJANGO_SETTINGS_MODULE", "ARTIFACT_ROOT")
        }
        token = secrets.token_urlsafe(16)
        env.update(
            s3.environment(bucket),
            DJANGO_SETTINGS_MODULE=SETTINGS_MODULE,
            DATABASE_URL=scratch,
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
            PYTHONUNBUFFERED="1",
            Q_LOG_LEVEL="INFO",
            LOG_LEVEL="INFO",
            JOBS_TENANT_CONCURRENCY=str(cfg.tenant_concurrency),
            SOAK_Q_WORKERS=str(cfg.workers),
            NOTICE_PROVIDER_TOKEN=token,
            NOTICE_PROVIDER_MAX_IN_FLIGHT=str(cfg.provider_in_flight),
            # A send (connect + read + slot wait) ends inside its sending lease (jobs.E010).
            NOTICE_PROVIDER_CONNECT_TIMEOUT="1",
            NOTICE_PROVIDER_READ_TIMEOUT="1",
            SOAK_EFFECT_LEASE_SECONDS="4",
            FAKE_PROVIDER_TOKEN=token,
            JOBS_EXPECTED_WORKER_PROCESSES=str(cfg.hosts),
            JOBS_EXPECTED_DISPATCHERS=str(cfg.hosts),
        )
        procs = Processes(env, logs, command=(sys.executable, str(ROOT / "manage.py")), cwd=ROOT)
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
        provider = procs.start(
            "provider", "fake_provider", "--port=0", f"--record={record}", stdout=subprocess.PIPE
        )
        line = provider.popen.stdout.readline().decode()
        if "listening on " not in line:
            raise RuntimeError(f"the stand-in provider did not start: {line!r}")
        env["NOTICE_PROVIDER_URL"] = line.split("listening on ", 1)[1].split()[0]

        # This process seeds and watches the same database with the hosts' settings.
        os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
        os.environ.update(Q_LOG_LEVEL="WARNING", LOG_LEVEL="WARNING")
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        import django

        django.setup()
        from django.conf import settings as dj_settings

        _say(
            "broker: "
            + (dj_settings.Q_CLUSTER.get("broker_class") or "django-q2's ORM broker")
            + f" (poll {dj_settings.Q_CLUSTER.get('poll')} s)"
        )

        hosts = []
        for n in range(cfg.hosts):
            host = Host(f"host-{'abcdefgh'[n]}", work / f"host-{'abcdefgh'[n]}")
            (host.folder / "tmp").mkdir(parents=True)
            host_env = {**env, "JOBS_HOST_NAME": host.name, "TMPDIR": str(host.folder / "tmp")}
            host.worker = procs.start(
                f"{host.name}.worker",
                "jobs_worker",
                "--stop-timeout=5",
                # Under load a qcluster takes more than the default 8 s to boot.
                "--stall-seconds=25",
                env=host_env,
            )
            host.dispatcher = procs.start(
                f"{host.name}.dispatcher", "jobs_dispatcher", "--interval", "0.5", env=host_env
            )
            hosts.append(host)
        # Work is asked for once every host's cluster runs: a host that boots late on a
        # busy machine found the backlog taken by the others and claimed nothing (seen).
        booted = wait_for_clusters(hosts, timeout=90)
        _say(f"every host's cluster running after {booted:.0f} s")
        t0 = time.monotonic()  # the hosts start on the first report while the rest are asked for
        seed(cfg, rng)
        _say(f"seeded {cfg.jobs} permit requests and requested their reports")
        deadline = t0 + cfg.timeout
        victim = rng.choice(hosts)
        kill_at_ended = max(1, int(cfg.jobs * cfg.kill_after))
        killed_t = None
        want_since = None
        next_report = t0 + 10
        settled = False
        while time.monotonic() < deadline:
            ended, total, final, effects = progress()
            now = time.monotonic()
            if killed_t is None and ended >= kill_at_ended:
                want_since = want_since or now
                # Kill while the victim holds a job (up to 5 s of waiting for one).
                if running_on(victim.name) or now - want_since > 5:
                    holding = running_on(victim.name)
                    procs.stop_all(victim.procs)
                    victim.killed_at = time.time()
                    killed_t = now - t0
                    _say(
                        f"  {killed_t:5.0f}s SIGKILLed {victim.name}'s process trees "
                        f"(holding {holding} running jobs); not restarted"
                    )
            if now >= next_report:
                next_report += 10
                _say(f"  {now - t0:5.0f}s jobs {ended}/{total} ended, effects {final}/{effects}")
            if killed_t is not None and ended == total and final == effects:
                settled = True
                break
            unexpected = procs.dead()
            if unexpected:
                _say(f"  exited unexpectedly: {unexpected}")
                break
            time.sleep(0.5)
        settle = time.monotonic() - t0
        unexpected = procs.dead()
        procs.stop_all()
        from django.db import connections

        connections.close_all()
        v = verify(cfg, hosts, s3, bucket, record)
        v.check(settled, f"not settled after {settle:.0f} s")
        v.check(not unexpected, f"processes exited unexpectedly: {unexpected}")
        v.check(killed_t is not None, "no host was killed")
        after_kill = settle - (killed_t or 0)
        summary = (
            f"jobs={cfg.jobs} hosts={cfg.hosts} killed={victim.name}@{killed_t or 0:.0f}s "
            f"settle={settle:.0f}s ({after_kill:.0f}s after the kill) "
            f"artifacts={v.figures.get('artifacts')} orphans={v.figures.get('orphans')} "
            f"effects={v.figures.get('effects')!r} "
            f"duplicate_effects={v.figures.get('duplicate_effects')} "
            f"provider_peak={v.figures.get('provider_peak')} "
            f"claims={v.figures.get('claims_by_host')}"
        )
        _say(f"  effect states {v.figures.get('effect_states')}")
        _say(f"  messages each host's dispatcher sent (its log): {dispatches(hosts)}")
        _say(
            f"  attempts by outcome {v.figures.get('attempts')}; jobs the killed host had "
            f"touched, finished by another: {v.figures.get('taken_over')}"
        )
        passed = not v.failures
        if passed:
            verdict = f"scaleout: PASS {summary} wall={time.monotonic() - started:.0f}s"
            return 0
        for failure in v.failures:
            _say(f"  check failed: {failure}")
        verdict = f"scaleout: FAIL {summary} failures={len(v.failures)}"
        return 1
    except Exception as exc:
        if procs is not None:
            _say(procs.logs(tail=20))
        verdict = f"scaleout: FAIL the drill could not run: {type(exc).__name__}: {exc}"
        return 2
    finally:
        if procs is not None:
            procs.stop_all()
        stack.close()
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        if created and not cfg.keep:
            scratchdb.drop(url, name)
        if cfg.keep or not passed:
            _say(f"kept {work}" + (f" and database {name}" if cfg.keep else ""))
        else:
            shutil.rmtree(work, ignore_errors=True)
        _say(verdict)  # the last line, after the clean-up


def parse(argv: list[str] | None = None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=d.jobs)
    p.add_argument("--hosts", type=int, default=d.hosts)
    p.add_argument("--workers", type=int, default=d.workers, help="django-q2 workers per host")
    p.add_argument("--provider-in-flight", type=int, default=d.provider_in_flight)
    p.add_argument("--timeout", type=float, default=d.timeout)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", action="store_true", help="keep the folder and the database")
    a = p.parse_args(argv)
    return Config(
        jobs=a.jobs,
        hosts=a.hosts,
        workers=a.workers,
        provider_in_flight=a.provider_in_flight,
        timeout=a.timeout,
        seed=a.seed,
        keep=a.keep,
    )


def _interrupted(signum, frame):
    raise KeyboardInterrupt  # the finally blocks stop every process and drop the database


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    return run(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
