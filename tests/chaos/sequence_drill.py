"""The sequence drill: ``python -m tests.chaos.sequence_drill`` (``make sequence-drill``;
issue 42, part 2, docs/app/sequences.md).

Three "hosts" on one machine (each its own ``manage.py jobs_worker`` with its own host
name), one PostgreSQL scratch database, the stand-in notice provider. 50 permit requests
(the keys: the site's report kind is sequenced per request) each get 6 revisions'
reports (the items), asked for revision by revision. Each report publishes an in-app
notice and a webhook notice to its reviewer. Faults while they run:

- random SIGKILLs of a host's whole process tree (restarted at once);
- one SIGSTOP of a host past the job lease (then SIGCONT): its work is reclaimed, and
  whatever it tries after is fenced;
- the provider answers every send 500 for 20 s (after its first 40 sends): the webhook
  notices wait in ``pending``/``unknown``, and so must the next revisions;
- the first request's reports die (its work type is outside the choices; tried to
  their budget): each holds the key; the drill releases it as an operator would on the console
  (``sequences.release``), and counts it. Any other report that ends failed or dead
  is released the same way.

The verdict reads the database and the provider's own record:

- every job ended and every effect settled;
- per key, the items started in request order (first attempts, by the server's clock);
- no item started before the item before it ended, nor before each of its effects
  settled (its last ledger event into a settled state), nor before its release;
  every report of the failing key but its last was released (the last holds nothing);
- the provider applied no effect twice, one in-app notice per in-app effect.

The last line is ``sequence: PASS ...`` or ``sequence: FAIL ...``; exit 1 on FAIL, 2
when the drill could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

from jobs.testing import scratchdb
from jobs.testing.processes import Processes
from jobs.testing.proctree import groups_of

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_MODULE = "tests.chaos.scaleout_settings"


def _say(line: str) -> None:
    print(line, flush=True)


def seed(keys: int, items: int) -> None:
    """``keys`` permit requests in review, a reviewer each, and ``items`` revisions'
    reports each, asked for revision by revision (the request order of every key)."""
    from decimal import Decimal

    from django.contrib.auth import get_user_model

    from permits.models import PermitRequest, Tenant
    from permits.services import assign_reviewer, report_request

    tenant, _ = Tenant.objects.get_or_create(key="springfield", defaults={"name": "Springfield"})
    users = [get_user_model().objects.create_user(username=f"seq-{n}") for n in range(5)]
    permits = []
    for i in range(keys):
        permit = PermitRequest.objects.create(
            tenant=tenant,
            reference=f"SEQ-{i:04d}",
            site_address=f"{i} Sequence Street",
            parcel=f"SQ-{i:04d}",
            # The first request's work type is outside the choices: each of its reports is
            # tried to its budget, ends dead and holds its key until the drill releases it.
            work_type="unknown-work" if i == 0 else PermitRequest.WorkType.values[0],
            description="Plans as submitted.",
            valuation=Decimal(10_000 + i),
            status=PermitRequest.Status.IN_REVIEW,
            output_revision=items,
            applicant_name=f"Applicant {i}",
            applicant_phone=f"+1 555 {i:05d}",
            applicant_email=f"seq{i}@example.org",
            applicant_id_number=f"SQ-{i:05d}",
        )
        assign_reviewer(permit, users[i % len(users)])
        permits.append(permit)
    for revision in range(1, items + 1):
        for permit in permits:
            report_request(permit, revision=revision)


def progress() -> tuple[int, int, int, int]:
    from jobs.models import Effect, Job

    ended = Job.objects.filter(state__in=Job.TERMINAL).count()
    final = Effect.objects.filter(state__in=Effect.FINAL).count()
    return ended, Job.objects.count(), final, Effect.objects.count()


def release_dead_holders() -> int:
    """An operator's release of each dead or failed report holding its key."""
    from jobs import sequences

    return sum(
        sequences.release(b.holder, operator="drill") for b in sequences.blocked() if b.releasable
    )


def _starts() -> dict[int, object]:
    """Each job's first start (its first claim's attempt), by the server's clock."""
    from django.db.models import Min

    from jobs.models import Attempt

    claims = Attempt.objects.filter(number__gt=0).exclude(
        outcome__in=[Attempt.Outcome.DEFERRED, Attempt.Outcome.DUPLICATE_DELIVERY]
    )
    return dict(claims.values("job_id").annotate(m=Min("started_at")).values_list("job_id", "m"))


def _settled_at() -> dict[int, object]:
    """Per job, when its last effect settled (its last event into a settled state)."""
    from django.db.models import Max

    from jobs.models import Effect, EffectEvent

    events = EffectEvent.objects.filter(outcome__in=Effect.FINAL)
    rows = events.values("effect__job_id").annotate(m=Max("at"))
    return dict(rows.values_list("effect__job_id", "m"))


def check_order() -> tuple[list[str], int]:
    """Problems with the keys' order, and how many starts were checked."""
    from jobs.models import Job, JobEvent

    starts, settled = _starts(), _settled_at()
    releases = dict(JobEvent.objects.filter(action="release_sequence").values_list("job_id", "at"))
    by_key = defaultdict(list)
    from permits.reports import KIND

    reports = Job.objects.filter(kind=KIND).order_by("pk")
    for pk, key, finished in reports.values_list("pk", "sequence_key", "finished_at"):
        by_key[key].append((pk, finished))
    problems, checked = [], 0
    for key, items in by_key.items():
        if not key:
            problems.append(f"{len(items)} report jobs without a sequence key")
            continue
        started = [starts.get(pk) for pk, _ in items]
        if None in started:
            problems.append(f"{key}: a job never started")
            continue
        if started != sorted(started):
            problems.append(f"{key}: started out of request order")
        for (pk, finished), next_start in zip(items, started[1:], strict=False):
            checked += 1
            if finished is None or next_start < finished:
                problems.append(f"{key}: the job after {pk} started before {pk} ended")
            if pk in settled and next_start < settled[pk]:
                problems.append(f"{key}: the job after {pk} started before its effects settled")
            if pk in releases and next_start < releases[pk]:
                problems.append(f"{key}: the job after {pk} started before its release")
    return problems, checked


def check_effects(record_path: Path) -> tuple[list[str], int, dict[str, int]]:
    """Problems with the effects (unsettled, applied twice), the duplicate count and the
    effects by state."""
    from django.db.models import Count

    from jobs.models import Effect, Job, Notice
    from jobs.testing.provider_record import Record

    problems = []
    open_jobs = Job.objects.exclude(state__in=Job.TERMINAL).count()
    open_effects = Effect.objects.exclude(state__in=Effect.FINAL).count()
    if open_jobs or open_effects:
        problems.append(f"{open_jobs} jobs not ended, {open_effects} effects not settled")
    record = Record(record_path)
    duplicates = record.duplicate_effects()
    answered_500 = sum(1 for r in record.requests() if r["status"] == 500)
    if not answered_500:
        problems.append("the provider never answered 500: no error window")
    if duplicates:
        problems.append(f"effects applied twice: {list(duplicates)[:5]}")
    twice = Notice.objects.values("effect_id").annotate(n=Count("id")).filter(n__gt=1).count()
    if twice:
        problems.append(f"{twice} in-app effects with two notices")
    states = Effect.objects.values_list("state").annotate(n=Count("id")).order_by("state")
    return problems, len(duplicates) + twice, {**dict(states), "sends_answered_500": answered_500}


class Chaos:
    """The faults: SIGKILLs of a host (restarted), one SIGSTOP past the lease."""

    def __init__(self, procs: Processes, env: dict, work: Path, hosts: int, rng) -> None:
        self.procs, self.env, self.work, self.rng = procs, env, work, rng
        self.names = [f"host-{'abc'[i]}" for i in range(hosts)]
        self.workers = {name: self._start(name, 0) for name in self.names}
        self.kills = self.stops = 0
        self.next_kill = time.monotonic() + rng.uniform(8, 15)
        self.stop_at = time.monotonic() + rng.uniform(20, 30)
        self.stopped = None

    def _start(self, name: str, n: int):
        folder = self.work / f"{name}-{n}" / "tmp"
        folder.mkdir(parents=True)
        host_env = {**self.env, "JOBS_HOST_NAME": name, "TMPDIR": str(folder)}
        return self.procs.start(
            f"{name}.{n}", "jobs_worker", "--stop-timeout=5", "--stall-seconds=25", env=host_env
        )

    def _signal(self, name: str, sig: int) -> None:
        for pgid in groups_of(self.workers[name].pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)

    def tick(self, lease: float) -> None:
        now = time.monotonic()
        if self.stopped is not None and now >= self.stopped[1]:
            self._signal(self.stopped[0], signal.SIGCONT)
            _say(f"  SIGCONT {self.stopped[0]}")
            self.stopped = None
        if self.stops == 0 and now >= self.stop_at:
            name = self.rng.choice(self.names)
            self._signal(name, signal.SIGSTOP)
            self.stopped, self.stops = (name, now + 4 * lease), 1
            _say(f"  SIGSTOP {name} for {4 * lease:g}s (the lease is {lease:g}s)")
        if now >= self.next_kill:
            name = self.rng.choice(
                [n for n in self.names if not self.stopped or n != self.stopped[0]]
            )
            self.procs.kill_group(self.workers[name])
            self.kills += 1
            self.workers[name] = self._start(name, self.kills)
            self.next_kill = now + self.rng.uniform(10, 20)
            _say(f"  SIGKILL {name} (kill {self.kills}), restarted")


def _environment(scratch: str, work: Path, args, token: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TEST_DATABASE_NAME", "DJANGO_SETTINGS_MODULE", "ARTIFACT_ROOT")
    }
    env.update(
        DJANGO_SETTINGS_MODULE=SETTINGS_MODULE,
        DATABASE_URL=scratch,
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        Q_LOG_LEVEL="INFO",
        LOG_LEVEL="WARNING",
        SOAK_Q_WORKERS=str(args.workers),
        JOBS_TENANT_CONCURRENCY=str(args.hosts * args.workers),
        ARTIFACT_ROOT=str(work / "artifacts"),
        NOTICE_PROVIDER_TOKEN=token,
        FAKE_PROVIDER_TOKEN=token,
        NOTICE_PROVIDER_CONNECT_TIMEOUT="1",
        NOTICE_PROVIDER_READ_TIMEOUT="1",
        SOAK_EFFECT_LEASE_SECONDS="4",
    )
    return env


def _drive(chaos: Chaos, args, lease: float) -> tuple[bool, int, float]:
    """Run the faults until every job ended and every effect settled (or the timeout):
    (settled, releases by the operator, seconds)."""
    t0 = time.monotonic()
    released, next_report = 0, t0 + 15
    while time.monotonic() - t0 < args.timeout:
        chaos.tick(lease)
        ended, total, final, effects = progress()
        if ended == total and final == effects and chaos.stopped is None:
            return True, released, time.monotonic() - t0
        released += release_dead_holders()
        if time.monotonic() >= next_report:
            next_report += 15
            _say(f"  {time.monotonic() - t0:5.0f}s jobs {ended}/{total}, effects {final}/{effects}")
        time.sleep(0.5)
    return False, released, time.monotonic() - t0


def _provider(procs: Processes, record: Path, error_seconds: float) -> str:
    """The stand-in provider, answering 500 for ``error_seconds`` after 40 sends: its URL."""
    provider = procs.start(
        "provider",
        "fake_provider",
        "--port=0",
        f"--record={record}",
        "--error-after=40",
        f"--error-seconds={error_seconds:g}",
        stdout=subprocess.PIPE,
    )
    line = provider.popen.stdout.readline().decode()
    if "listening on " not in line:
        raise RuntimeError(f"the stand-in provider did not start: {line!r}")
    return line.split("listening on ", 1)[1].split()[0]


def run(args: argparse.Namespace) -> int:
    try:
        url = scratchdb.server_url(purpose="the sequence drill")
    except scratchdb.NotPostgres as exc:
        _say(f"sequence: cannot run: {exc}")
        return 2
    name = f"sequence_{secrets.token_hex(5)}"
    work = ROOT / "var" / "sequence" / name
    (work / "logs").mkdir(parents=True)
    procs = None
    verdict = "sequence: FAIL interrupted"
    try:
        env = _environment(scratchdb.create(url, name), work, args, secrets.token_urlsafe(16))
        subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "migrate", "--noinput", "-v0"],
            cwd=ROOT,
            env=env,
            check=True,
            timeout=300,
        )
        procs = Processes(
            env, work / "logs", command=(sys.executable, str(ROOT / "manage.py")), cwd=ROOT
        )
        record = work / "provider.sqlite3"
        env["NOTICE_PROVIDER_URL"] = _provider(procs, record, args.error_seconds)
        os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
        os.environ.update(Q_LOG_LEVEL="WARNING")
        sys.path.insert(0, str(ROOT))
        import django

        django.setup()
        from jobs import conf

        lease = conf.lease_seconds()
        chaos = Chaos(procs, env, work, args.hosts, random.Random(args.seed))
        _say(f"sequence {name}: {args.keys} keys x {args.items} items, {args.hosts} hosts")
        seed(args.keys, args.items)
        settled, released, seconds = _drive(chaos, args, lease)
        procs.stop_all()
        from django.db import connections

        connections.close_all()
        order, checked = check_order()
        effects, duplicates, states = check_effects(record)
        failures = ([] if settled else [f"not settled after {seconds:.0f}s"]) + order + effects
        if released < args.items - 1:  # the last one holds nothing after it
            failures.append(f"{released} releases of the failing key's {args.items} reports")
        for failure in failures[:20]:
            _say(f"  check failed: {failure}")
        summary = (
            f"keys={args.keys} items={args.items} hosts={args.hosts} starts_checked={checked} "
            f"kills={chaos.kills} sigstops={chaos.stops} provider_500s={args.error_seconds:g}s "
            f"released_by_operator={released} duplicate_effects={duplicates} "
            f"settled_in={seconds:.0f}s effects={states}"
        )
        verdict = f"sequence: {'FAIL' if failures else 'PASS'} {summary}"
        return 1 if failures else 0
    except Exception as exc:
        if procs is not None:
            _say(procs.logs(tail=20))
        traceback.print_exc()
        verdict = f"sequence: FAIL the drill could not run: {type(exc).__name__}: {exc}"
        return 2
    finally:
        if procs is not None:
            procs.stop_all()
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        with contextlib.suppress(Exception):
            scratchdb.drop(url, name)
        if verdict.startswith("sequence: PASS"):
            shutil.rmtree(work, ignore_errors=True)
        else:
            _say(f"kept {work}")
        _say(verdict)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=50)
    parser.add_argument("--items", type=int, default=6)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="per host")
    parser.add_argument("--error-seconds", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=None)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
