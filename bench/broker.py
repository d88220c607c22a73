"""The jobs table against plain django-q2 tasks on django-q2's own brokers.

Three clusters (the production ``Q_CLUSTER``, only ``broker_class`` differs): the jobs
table (``jobs.claiming.ClaimingBroker``) runs the engine's minimal kind
(``demo.summary``); django-q2's ORM broker (polls every ``poll``) and
``jobs.broker.PostgresBroker`` (woken by NOTIFY) run the same work as plain tasks
(``bench.plain.plain_minimal``: no engine), since no engine job has a message any more.
Each serves idle singles (enqueued at random points of the poll cycle; enqueue commit →
``succeeded``, or → the plain task's notice row), a burst of 83 in one transaction, 83
bare no-ops (the floor under any burst), then a quiet window: its transactions per
second, counted at the server (``pg_stat_database`` of the bench database, read from
the maintenance database so the reading adds nothing). The benchmark's schedule table
is empty (``infra.reset_run_tables``): the quiet figure is the cluster alone.

Each cluster chooses its broker by ``Q_BROKER`` (``permits.settings``), and this
process enqueues through the same broker (django-q2's ``Conf.BROKER_CLASS``,
patched for the run).
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field

from django.db import connection, transaction
from django.utils import timezone

import jobs
from bench import infra, workloads
from bench.latency import BURST, Series, pct
from jobs.models import Attempt, Job, Notice
from jobs.testing import scratchdb

ORM, PG, JOBS = "orm", "postgres", "jobs"
LABELS = {
    ORM: "plain tasks, ORM broker (poll)",
    PG: "plain tasks, PostgreSQL broker (NOTIFY)",
    JOBS: "engine jobs, jobs table (claim, NOTIFY)",
}
BROKER_CLASSES = {ORM: None, PG: "jobs.broker.PostgresBroker", JOBS: "jobs.claiming.ClaimingBroker"}


@dataclass
class BrokerRun:
    broker: str
    idle: Series
    burst: Series
    noop_burst_ms: float = float("nan")  # 83 bare django-q2 no-ops: enqueue commit → drained
    # The ORM broker only: 83 plain tasks doing the minimal kind's work (``bench.plain``),
    # enqueue commit → each one's notice written; the bar the jobs table's burst is held to.
    plain_burst_ms: list[float] = field(default_factory=list)
    # The engine's idle singles split at the claim (the attempt's start): enqueue commit →
    # claimed (the wake and the claim) and claimed → succeeded (the work and the publish).
    idle_claim_ms: list[float] = field(default_factory=list)
    idle_work_ms: list[float] = field(default_factory=list)
    quiet_xacts_s: float = float("nan")
    quiet_window_s: float = 0.0
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _enqueue_through(broker: str):
    """This process's enqueues go through ``broker`` (django-q2 reads Conf per call)."""
    from django_q.conf import Conf

    before = Conf.BROKER_CLASS
    Conf.BROKER_CLASS = BROKER_CLASSES[broker]  # None: the ORM broker
    try:
        yield
    finally:
        Conf.BROKER_CLASS = before


def _env(broker: str) -> dict[str, str]:
    # The site's default on PostgreSQL is the jobs table (Q_BROKER=jobs).
    return {"Q_BROKER": broker}


def _enqueue(n: int, user_id: int, tag: str) -> tuple[list[int], object]:
    with transaction.atomic():
        ids = [
            jobs.request(
                workloads.SUMMARY,
                ("bench.broker", f"{tag}-{i}"),
                tenant="bench",
                params={"notify_user_id": user_id},
            ).job.pk
            for i in range(n)
        ]
    return ids, timezone.now()


def _wait(what: str, check, c: infra.Cluster, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if not c.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"broker bench: timed out waiting for {what}\n{c.log_tail()}")
        time.sleep(0.002)


def _succeeded(ids: list[int]) -> bool:
    return Job.objects.filter(pk__in=ids, state=Job.State.SUCCEEDED).count() == len(ids)


def _ms(later, earlier) -> float:
    return (later - earlier).total_seconds() * 1000


def _server_xacts() -> int:
    with scratchdb.admin_connection(infra.server_url()) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            [infra.E2E_DB],
        ).fetchone()
    return row[0]


def _noop_burst_ms(c: infra.Cluster) -> float:
    """83 ``bench.noop.noop`` tasks in one transaction; ms from its commit until the last
    message is acknowledged (the queue table read every 2 ms from another session)."""
    from django_q.tasks import async_task

    with transaction.atomic():
        for _ in range(BURST):
            async_task("bench.noop.noop")
    at = time.monotonic()
    with infra.connect(infra.E2E_DB) as watch:
        while watch.execute("SELECT count(*) FROM django_q_ormq").fetchone()[0]:
            if not c.alive() or time.monotonic() - at > 60:
                raise RuntimeError(f"broker bench: the no-op burst did not drain\n{c.log_tail()}")
            time.sleep(0.002)
    return (time.monotonic() - at) * 1000


def _plain_burst_ms(user_id: int, c: infra.Cluster, n: int = BURST) -> list[float]:
    """``n`` ``bench.plain.plain_minimal`` tasks (the minimal kind's work, no engine) in one
    transaction; per task, ms from its commit until its notice row was written (the
    worker's clock, this host's)."""
    from django_q.tasks import async_task

    from bench.models import PlainNotice

    first = (PlainNotice.objects.order_by("-pk").values_list("pk", flat=True).first() or 0) + 1
    tag = f"burst{time.monotonic_ns()}"
    with transaction.atomic():
        for i in range(n):
            async_task("bench.plain.plain_minimal", user_id, tag, i)
    at = timezone.now()
    written = PlainNotice.objects.filter(pk__gte=first)
    _wait("the plain tasks", lambda: written.count() >= n, c)
    return [_ms(created, at) for created in written.values_list("created_at", flat=True)]


def run_one(
    broker: str, user_id: int, workers: int, *, singles: int, quiet: float, progress=print
) -> BrokerRun:
    """One broker: idle singles, a burst of 83, a quiet window; a fresh cluster."""
    infra.reset_run_tables()
    idle = Series(f"{LABELS[broker]}: idle single job, enqueue → succeeded")
    burst = Series(f"{LABELS[broker]}: in-app burst of {BURST}, enqueue → succeeded")
    out = BrokerRun(broker, idle, burst)
    engine = broker == JOBS  # the other brokers carry plain tasks only
    with _enqueue_through(broker), infra.cluster(workers, f"broker-{broker}", **_env(broker)) as c:
        if engine:
            ids, _ = _enqueue(workers * 2, user_id, "warm")
            _wait("warm-up jobs", lambda: _succeeded(ids), c)
        else:
            _plain_burst_ms(user_id, c, n=workers * 2)
        time.sleep(1.0)  # the listener is up and has heard its probe
        rng = random.Random(29)
        for k in range(singles):
            time.sleep(0.25 + rng.random() * 0.5)  # anywhere in the poll cycle
            if engine:
                [pk], at = _enqueue(1, user_id, f"single{k}")
                _wait("a single job", lambda pk=pk: _succeeded([pk]), c)
                done = Job.objects.get(pk=pk)
                claimed = Attempt.objects.filter(job=done).order_by("number").first()
                idle.values_ms.append(_ms(done.finished_at, at))
                out.idle_claim_ms.append(_ms(claimed.started_at, at))
                out.idle_work_ms.append(_ms(done.finished_at, claimed.started_at))
            else:
                idle.values_ms += _plain_burst_ms(user_id, c, n=1)
        progress(f"broker {broker}: idle single p50 {idle.p(50):.0f} ms")

        time.sleep(0.5)
        if engine:
            ids, at = _enqueue(BURST, user_id, "burst")
            _wait(
                "the burst",
                lambda: Notice.objects.filter(effect__job_id__in=ids).count() == BURST,
                c,
            )
            finished = dict(Job.objects.filter(pk__in=ids).values_list("pk", "finished_at"))
            burst.values_ms += [_ms(finished[pk], at) for pk in ids]
        else:
            burst.values_ms += _plain_burst_ms(user_id, c)
            out.plain_burst_ms = list(burst.values_ms)
        progress(f"broker {broker}: burst of {BURST} p99 {burst.p(99):.0f} ms")

        # The floor under any burst on this cluster: 83 bare no-ops, the queue emptied.
        time.sleep(0.5)
        out.noop_burst_ms = _noop_burst_ms(c)
        progress(f"broker {broker}: {BURST} bare no-ops drained in {out.noop_burst_ms:.0f} ms")

        if quiet > 0:
            connection.close()  # this process stays out of the count
            # A backend that flushed its statistics less than 1 s before going idle holds
            # the rest for up to 10 s (PostgreSQL 15's PGSTAT_IDLE_INTERVAL): wait them out.
            time.sleep(12.0)
            before = _server_xacts()
            time.sleep(quiet)
            out.quiet_xacts_s = (_server_xacts() - before) / quiet
            out.quiet_window_s = quiet
            progress(f"broker {broker}: quiet cluster {out.quiet_xacts_s:.2f} transactions/s")
        if not c.alive():
            out.notes.append("the cluster died during the run")
    return out


def run(user_id: int, workers: int, *, singles: int = 20, quiet: float = 30.0, progress=print):
    """Every broker, the ORM broker first; returns ``{broker: BrokerRun}``."""
    return {
        b: run_one(b, user_id, workers, singles=singles, quiet=quiet, progress=progress)
        for b in (ORM, PG, JOBS)
    }


def as_json(runs: dict[str, BrokerRun]) -> dict:
    return {
        b: {
            "idle_ms": r.idle.values_ms,
            "idle_claim_ms": r.idle_claim_ms,
            "idle_work_ms": r.idle_work_ms,
            "burst_ms": r.burst.values_ms,
            "noop_burst_ms": r.noop_burst_ms,
            "plain_burst_ms": r.plain_burst_ms,
            "quiet_xacts_s": r.quiet_xacts_s,
            "quiet_window_s": r.quiet_window_s,
            "notes": r.notes,
        }
        for b, r in runs.items()
    }


def _split_line(label: str, total: list, claim: list, work: list) -> str:
    """Where the idle singles' time went: enqueue → claimed and claimed → succeeded, as
    p50 and max, and the slowest single's two parts (its outlier's phase)."""
    slowest = max(range(len(total)), key=total.__getitem__)
    return (
        f"  {label:36} idle split     enqueue→claimed p50 {pct(claim, 50):.0f} max "
        f"{max(claim):.0f}; claimed→succeeded p50 {pct(work, 50):.0f} max {max(work):.0f}; "
        f"slowest {total[slowest]:.0f} = {claim[slowest]:.0f} + {work[slowest]:.0f} ms"
    )


def report_lines(res: dict, poll: float) -> tuple[list[str], list[str]]:
    """The section's table and its summary line, from ``as_json``'s figures."""
    if not res:
        return [], []
    nan = float("nan")
    lines = [
        "",
        "brokers (ms, enqueue commit → the job's succeeded or the plain task's notice; quiet: "
        "transactions/s)",
    ]

    def trio(v):
        return "/".join(f"{pct(v, p):.0f}" for p in (50, 95, 99)) if v else "n/a"

    for b, r in res.items():
        for name, key in (("idle single", "idle_ms"), (f"burst of {BURST}", "burst_ms")):
            v = r[key]
            lines.append(
                f"  {LABELS[b]:36} {name:14} p50 {pct(v, 50):6.0f}  p95 {pct(v, 95):6.0f}  "
                f"p99 {pct(v, 99):6.0f}  (n={len(v)})"
            )
        if r.get("idle_claim_ms"):
            split = (r["idle_ms"], r["idle_claim_ms"], r["idle_work_ms"])
            lines.append(_split_line(LABELS[b], *split))
        lines.append(
            f"  {LABELS[b]:36} {BURST} bare no-ops drained in {r.get('noop_burst_ms', nan):.0f} ms "
            "(the floor under any burst on this cluster)"
        )
        lines.append(
            f"  {LABELS[b]:36} quiet cluster  {r['quiet_xacts_s']:.2f} transactions/s at the "
            f"server over {r['quiet_window_s']:.0f} s" + "".join(f"; {n}" for n in r["notes"])
        )
    summary = (
        "brokers p50/p95/p99 ms idle single | burst of 83; quiet transactions/s: "
        + "; ".join(
            f"{b} {trio(r['idle_ms'])} | {trio(r['burst_ms'])} (no-ops "
            f"{r.get('noop_burst_ms', nan):.0f}); {r['quiet_xacts_s']:.2f}/s"
            for b, r in res.items()
        )
    )
    plain = res.get(ORM, {}).get("plain_burst_ms") or []
    ours = res.get(JOBS, {}).get("burst_ms") or []
    if plain and ours:
        summary += (
            f"; in-app burst of {BURST} p99: jobs table {pct(ours, 99):.0f} ms against plain "
            f"django-q2 tasks on the ORM broker {pct(plain, 99):.0f} ms"
        )
    return lines, [summary + f" (ORM poll {poll} s)"]
