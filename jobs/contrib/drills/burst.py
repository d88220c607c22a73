"""The outage-then-recovery burst: ``manage.py burst --jobs 83``.

With the stand-in provider down (its port refuses connections), N jobs of the
synthetic kind ``jobs.burst`` run in several worker *processes*, each job
publishes one webhook notice, and every first send fails with a transport
error: the notices queue up in the ledger with jittered backoff. Then the
provider comes back and the same processes deliver them, each send inside one
of the provider's in-flight slots.

The verdict comes from the provider's own record (its SQLite file), not from
the ledger: the most calls it held open at once, calls per second after it came
back, notices applied, and effects applied twice. The ledger is only compared
against it (every effect applied, under the id the provider gave).

The workers run the real code paths: ``delivery.runner.run_delivery`` for jobs and
``delivery.release.release`` for due effects (what ``jobs.tasks.run_job`` and
``jobs.tasks.release_effect`` call inside django-q2). They pick work from the
database instead of the queue, partitioned by id so that no two of them chase
the same row; they are separate processes sharing only the database and the
provider, so the bound is enforced where it matters: across processes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections
from django.db.models import F, Q
from django.db.models.functions import Mod
from django.utils import timezone

from jobs import registry, rules
from jobs.delivery.release import release
from jobs.models import Effect, EffectEvent, FlowRule, Job
from jobs.registry import EffectSpec
from jobs.testing.fakeprovider import Record
from jobs.testing.processes import Processes

log = logging.getLogger("jobs.burst")

KIND = "jobs.burst"
SUBJECT_TYPE = "jobs.burstrun"
CONFIG_ENV = "JOBS_BURST_CONFIG"


# --- the synthetic job kind ---------------------------------------------------------


def handle(ctx) -> list[EffectSpec]:
    """Store a tiny artifact and ask for one notice through the chosen provider."""
    job = ctx.job
    recipient = ctx.params.get("recipient")
    ctx.check_owner()
    body = f"burst report: job {job.pk} revision {job.output_revision}\n".encode()
    artifact = ctx.store_artifact(body, content_type="text/plain", extension="txt")
    return [
        EffectSpec(
            "completion-notice",
            str(ctx.params.get("provider", "webhook")),
            str(recipient),
            {"report_key": artifact.key},
        )
    ]


def register_kind() -> None:
    registry.register_kind(KIND, handle, max_attempts=3)


# --- worker processes ---------------------------------------------------------------


def run_scope(run: str) -> Q:
    return Q(kind=KIND, subject_type=SUBJECT_TYPE, subject_id__startswith=f"{run}-")


def work_once(run: str, index: int, count: int, worker: str, stop=lambda: False) -> int:
    """Take this worker's share of due jobs and due effects of ``run``; returns items done."""
    from jobs.delivery.runner import run_delivery

    jobs = (
        Job.objects.filter(run_scope(run))
        .filter(rules.to_q(rules.any_of(rules.JOB_DUE, rules.JOB_LEASE_EXPIRED)))
        .annotate(part=Mod(F("id"), count))
        .filter(part=index)
        .order_by("id")
        .values_list("pk", flat=True)[:20]
    )
    done = 0
    for pk in list(jobs):
        if stop():
            return done
        run_delivery(pk, worker=worker)
        done += 1
    effects = (
        Effect.objects.filter(rules.to_q(rules.EFFECT_RELEASABLE))
        .filter(job__in=Job.objects.filter(run_scope(run)))
        .annotate(part=Mod(F("id"), count))
        .filter(part=index)
        .select_related("job")
        .order_by("next_attempt_at", "id")[:20]
    )
    for effect in list(effects):
        if stop():
            return done
        release(effect, worker)
        done += 1
    return done


def work(run: str, index: int, count: int, *, idle: float = 0.02) -> None:
    """Loop until SIGTERM: the body of one worker process."""
    from jobs.engine.job_machine import worker_identity

    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker = worker_identity()
    # This process exists for the drill: its settings are the run's, for its whole life.
    for name, value in json.loads(os.environ.get(CONFIG_ENV, "{}")).items():
        setattr(settings, name, value)
    while not stopping:
        try:
            busy = work_once(run, index, count, worker, lambda: stopping)
        except Exception:  # keep the worker alive; the row stays due and is retried
            log.exception("burst worker %s/%s: sweep failed", index, count)
            close_old_connections()
            busy = 0
        if not busy:
            time.sleep(random.uniform(idle / 2, idle * 1.5))


# --- the drill ----------------------------------------------------------------------


@dataclass
class BurstConfig:
    jobs: int = 83
    workers: int = 6
    max_in_flight: int = 4
    connect_timeout: float = 1.0
    read_timeout: float = 2.0
    slot_wait: float = 1.0
    effect_lease: float = 10.0
    provider_delay: float = 0.25  # latency of every answer: demand exceeds the bound
    down_seconds: float = 2.0  # minimum outage, counted after every job has finished
    backoff_floor: float = 0.2
    backoff_base: float = 0.5
    backoff_cap: float = 3.0
    effect_max_attempts: int = 60
    timeout: float = 240.0
    record: str | None = None
    rate: str | None = None  # a provider:webhook rate rule for the run, e.g. "5/s"
    circuit_failures: int = 5
    circuit_probe: float = 0.5
    circuit_probe_cap: float = 2.0

    def settings(self, url: str, token: str) -> dict:
        """The settings every worker process runs with (read at call time by the engine)."""
        return {
            "NOTICE_PROVIDER_URL": url,
            "NOTICE_PROVIDER_TOKEN": token,
            "NOTICE_PROVIDER_CONNECT_TIMEOUT": self.connect_timeout,
            "NOTICE_PROVIDER_READ_TIMEOUT": self.read_timeout,
            "NOTICE_PROVIDER_MAX_IN_FLIGHT": self.max_in_flight,
            "JOBS_PROVIDER_SLOT_WAIT_SECONDS": self.slot_wait,
            "JOBS_EFFECT_LEASE_SECONDS": self.effect_lease,
            "JOBS_EFFECT_MAX_ATTEMPTS": self.effect_max_attempts,
            "JOBS_BACKOFF_FLOOR_SECONDS": self.backoff_floor,
            "JOBS_BACKOFF_BASE_SECONDS": self.backoff_base,
            "JOBS_BACKOFF_CAP_SECONDS": self.backoff_cap,
            "JOBS_CIRCUIT_FAILURES": self.circuit_failures,
            "JOBS_CIRCUIT_PROBE_SECONDS": self.circuit_probe,
            "JOBS_CIRCUIT_PROBE_CAP_SECONDS": self.circuit_probe_cap,
        }

    def rate_rule(self) -> tuple[int, float] | None:
        if not self.rate:
            return None
        from jobs import flow

        rate, period = flow.parse_rate(self.rate)
        return None if rate is None else (rate, period)


@dataclass
class BurstReport:
    run: str
    config: dict
    jobs_succeeded: int = 0
    notices_expected: int = 0
    notices_applied: int = 0
    ledger_applied: int = 0
    missing: list[str] = field(default_factory=list)
    applied_twice: dict[str, int] = field(default_factory=dict)
    ledger_mismatch: list[str] = field(default_factory=list)
    max_in_flight: int = 0
    peak_calls_per_second: int = 0
    calls_per_second: list[tuple[int, int]] = field(default_factory=list)
    provider_requests: dict[str, int] = field(default_factory=dict)
    resends_same_key: int = 0
    refused_while_down: int = 0
    held_by_circuit: int = 0  # notices that waited at the open circuit, no call, no attempt
    max_in_rate_window: int = 0  # most calls in any window of the rate's period
    drain_calls_per_second: float | None = None
    outage_seconds: float = 0.0
    recovery_seconds: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def analyse(
    record: Record,
    expected: dict[str, tuple[str, str]],
    *,
    bound: int,
    up_at: float | None,
    report: BurstReport,
    rate: tuple[int, float] | None = None,
) -> BurstReport:
    """Judge the run from the provider's record; ``expected``: effect_id → (state, ref)."""
    sends = record.sends_by_effect()
    requests = record.requests()
    report.notices_expected = len(expected)
    report.notices_applied = sum(1 for e in expected if e in sends)
    report.missing = sorted(e for e in expected if e not in sends)
    report.applied_twice = {e: len(s) for e, s in sends.items() if len(s) > 1}
    report.ledger_applied = sum(1 for state, _ in expected.values() if state == "applied")
    report.ledger_mismatch = sorted(
        e
        for e, (state, ref) in expected.items()
        if e in sends and (state != "applied" or ref != sends[e][0]["send_id"])
    )
    report.max_in_flight = record.max_in_flight()
    origin = up_at if up_at is not None else (requests[0]["received_at"] if requests else 0.0)
    report.calls_per_second = record.calls_per_second(origin=origin)
    report.peak_calls_per_second = max((n for _, n in report.calls_per_second), default=0)
    by_answer: dict[str, int] = {}
    for r in requests:
        label = f"{r['status']} {r['outcome']}"
        by_answer[label] = by_answer.get(label, 0) + 1
    report.provider_requests = by_answer
    keys = [r["idempotency_key"] for r in requests if r["status"] in (200, 201)]
    report.resends_same_key = len(keys) - len(set(keys))
    stray = sorted(set(sends) - set(expected))
    if rate is not None:
        allowed, period = rate
        report.max_in_rate_window = max_in_window([r["received_at"] for r in requests], period)
        if report.max_in_rate_window > allowed + 1:
            report.problems.append(
                f"rate exceeded: {report.max_in_rate_window} calls within {period:g} s "
                f"(rule {allowed} per {period:g} s, +1 for the window's edge)"
            )
    if report.max_in_flight > bound:
        report.problems.append(
            f"bound exceeded: {report.max_in_flight} calls in flight at once (bound {bound})"
        )
    if report.missing:
        report.problems.append(f"{len(report.missing)} notice(s) missing at the provider")
    if report.applied_twice:
        report.problems.append(f"{len(report.applied_twice)} notice(s) applied more than once")
    if report.ledger_mismatch:
        report.problems.append(
            f"{len(report.ledger_mismatch)} ledger row(s) disagree with the provider's record"
        )
    if stray:
        report.problems.append(f"{len(stray)} send(s) at the provider for unknown effects")
    return report


def max_in_window(times: list[float], period: float) -> int:
    """The most of ``times`` inside any half-open window ``[t, t + period)``."""
    times = sorted(times)
    best = start = 0
    for end, t in enumerate(times):
        while times[start] <= t - period:
            start += 1
        best = max(best, end - start + 1)
    return best


def _child_env() -> dict:
    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = settings.SETTINGS_MODULE
    # python -m django must import the settings package from wherever we run.
    top = sys.modules[settings.SETTINGS_MODULE.split(".")[0]]
    root = str(Path(top.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _wait(predicate, deadline: float, procs: Processes, what: str, pause: float = 0.1) -> None:
    while not predicate():
        if procs.dead():
            raise RuntimeError(f"{', '.join(procs.dead())} died while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(pause)


def _purge_queue_messages(job_ids: set[int]) -> None:
    """The burst's own workers ran these jobs: drop their django-q2 messages."""
    from django_q.models import OrmQ

    names = {f"job-{pk}" for pk in job_ids}
    stale = [m.pk for m in OrmQ.objects.all().iterator() if m.name() in names]
    OrmQ.objects.filter(pk__in=stale).delete()


def run(config: BurstConfig, *, out=None) -> BurstReport:
    """Run the drill end to end and return its report (``problems`` empty when it passed)."""
    say = out or (lambda line: None)
    run_id = f"b{timezone.now():%Y%m%d%H%M%S}{secrets.token_hex(3)}"
    work_dir = Path(tempfile.mkdtemp(prefix=f"burst-{run_id}-"))
    record_path = Path(config.record) if config.record else work_dir / "provider.sqlite3"
    report = BurstReport(run=run_id, config=asdict(config))
    procs = Processes(_child_env(), work_dir)
    deadline = time.monotonic() + config.timeout
    restore: tuple[int | None, float] = (None, 1.0)
    try:
        provider = _start_provider(config, procs, record_path, report)
        say(
            f"burst {run_id}: {config.jobs} jobs, {config.workers} worker processes, provider "
            f"{report.config['provider_url']} down; record {record_path}"
        )
        restore = _set_rate_rule(config, run_id, say)
        # The workers start (about a second each) while the jobs are being created.
        down_at = time.monotonic()
        for i in range(config.workers):
            procs.start(
                f"worker-{i}", "burst", "--worker", str(i), "--of", str(config.workers), run_id
            )
        scope = Job.objects.filter(pk__in=_ask_for_jobs(config, run_id))
        _wait_out_the_outage(config, scope, procs, deadline, down_at, report, say)
        provider.popen.send_signal(signal.SIGUSR2)
        up_clock = time.monotonic()
        effects = Effect.objects.filter(job__in=scope)
        _wait(
            lambda: effects.filter(state__in=list(Effect.FINAL)).count() == config.jobs,
            deadline,
            procs,
            "every notice to reach a final state",
            pause=0.05,
        )
        report.recovery_seconds = round(time.monotonic() - up_clock, 2)
        report.jobs_succeeded = scope.filter(state=Job.State.SUCCEEDED).count()
    except (RuntimeError, TimeoutError) as exc:
        report.problems.append(str(exc))
    finally:
        _stop(config, procs, run_id, restore, work_dir, report)
    return _judge(config, run_id, record_path, report)


def _start_provider(config: BurstConfig, procs: Processes, record_path: Path, report) -> object:
    """The stand-in provider, down at first; its URL goes to the workers' settings."""
    token = secrets.token_urlsafe(16)
    procs.env["FAKE_PROVIDER_TOKEN"] = token  # not on the command line
    provider = procs.start(
        "provider",
        "fake_provider",
        "--port",
        "0",
        "--record",
        str(record_path),
        "--delay",
        str(config.provider_delay),
        "--start-down",
        stdout=subprocess.PIPE,
    )
    line = provider.popen.stdout.readline().decode()
    if "listening on " not in line:
        raise RuntimeError(f"the stand-in provider did not start: {line!r}")
    url = line.split("listening on ", 1)[1].split()[0]
    report.config["provider_url"] = url
    procs.env[CONFIG_ENV] = json.dumps(config.settings(url, token))
    return provider


def _set_rate_rule(config: BurstConfig, run_id: str, say) -> tuple[int | None, float]:
    """The run's rate rule on ``provider:webhook``; returns the rule to put back after."""
    rule = config.rate_rule()
    if rule is None:
        return (None, 1.0)
    from jobs import flow

    previous = FlowRule.objects.filter(scope="provider:webhook").first()
    restore = (previous.rate, previous.period_seconds) if previous else (None, 1.0)
    flow.set_rule(
        "provider:webhook",
        actor=f"burst:{run_id}",
        rate=rule[0],
        period_seconds=rule[1],
        note="burst drill",
    )
    say(f"rate rule provider:webhook {config.rate} for the run")
    return restore


def _ask_for_jobs(config: BurstConfig, run_id: str) -> set[int]:
    """The run's jobs through ``jobs.request``, one notice each; the workers find them."""
    from django.contrib.auth import get_user_model

    import jobs

    user, _ = get_user_model().objects.get_or_create(
        username="burst-recipient", defaults={"is_active": True}
    )
    if not user.is_active:
        get_user_model().objects.filter(pk=user.pk).update(is_active=True)
    job_ids = set()
    for i in range(config.jobs):
        job = jobs.request(
            KIND,
            (SUBJECT_TYPE, f"{run_id}-{i}"),
            params={"recipient": user.pk, "provider": "webhook"},
        ).job
        job_ids.add(job.pk)
    _purge_queue_messages(job_ids)
    return job_ids


def _wait_out_the_outage(config, scope, procs, deadline, down_at, report, say) -> None:
    """Every job succeeds and every notice meets the outage (a send refused, or held at
    the provider's open circuit without a call); none is applied while it is down."""
    effects = Effect.objects.filter(job__in=scope)
    held_at_circuit = Q(events__action=EffectEvent.Action.DEFER, events__error_code="circuit_open")
    met_outage = Q(attempts__gte=1) | held_at_circuit | Q(events__action=EffectEvent.Action.SEND)

    def queued_up() -> bool:
        return (
            scope.filter(state=Job.State.SUCCEEDED).count() == config.jobs
            and effects.filter(met_outage).exclude(state=Effect.State.SENDING).distinct().count()
            == config.jobs
        )

    _wait(queued_up, deadline, procs, "every job to finish with its notice queued")
    jobs_done_at = time.monotonic()
    applied_early = effects.filter(state=Effect.State.APPLIED).count()
    if applied_early:
        raise RuntimeError(f"{applied_early} notices applied while the provider was down")
    time.sleep(max(0.0, config.down_seconds - (time.monotonic() - jobs_done_at)))
    report.outage_seconds = round(time.monotonic() - down_at, 2)
    report.refused_while_down = EffectEvent.objects.filter(
        effect__in=effects, action=EffectEvent.Action.SEND, error_class="transport"
    ).count()
    report.held_by_circuit = effects.filter(held_at_circuit).distinct().count()
    say(
        f"outage: {config.jobs} jobs succeeded, {config.jobs} notices queued, "
        f"{report.refused_while_down} sends refused, {report.held_by_circuit} notices held "
        f"at the open circuit in {report.outage_seconds:.1f} s; provider comes back"
    )


def _stop(config, procs, run_id, restore, work_dir, report) -> None:
    """Stop every process, put the rate rule back, and name any process that died badly."""
    for proc in reversed(procs.procs):
        procs.terminate(proc)
    if config.rate_rule() is not None:
        from jobs import flow

        flow.set_rule(
            "provider:webhook",
            actor=f"burst:{run_id}",
            rate=restore[0],
            period_seconds=restore[1],
            note="burst drill ended",
        )
    dead = [p.name for p in procs.procs if p.popen.returncode not in (0, -signal.SIGTERM)]
    if dead:
        names = ", ".join(dead)
        report.problems.append(f"process(es) exited badly: {names} (logs in {work_dir})")


def _judge(config: BurstConfig, run_id: str, record_path: Path, report) -> BurstReport:
    """Hold the provider's record against the ledger (``analyse``)."""
    if not record_path.exists():
        report.problems.append("the provider left no record")
        return report
    record = Record(record_path)
    expected = {
        effect_id: (state, ref)
        for effect_id, state, ref in Effect.objects.filter(
            job__kind=KIND, job__subject_id__startswith=f"{run_id}-"
        ).values_list("effect_id", "state", "provider_ref")
    }
    problems_before = list(report.problems)
    report.problems = []
    analyse(
        record,
        expected,
        bound=config.max_in_flight,
        up_at=record.last_event_at("up"),
        report=report,
        rate=config.rate_rule(),
    )
    if report.recovery_seconds and report.notices_applied:
        report.drain_calls_per_second = round(report.notices_applied / report.recovery_seconds, 2)
    report.problems = problems_before + report.problems
    return report
