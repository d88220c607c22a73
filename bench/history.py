"""History at scale (issue 46): the engine's cost with 0, 1M and 10M finished jobs behind it.

``python -m bench --sections history [--history-sizes 0,1M,10M]`` (not in the default set).
Two scratch databases, made and migrated here and dropped at the end: ``bench_history``,
emptied and loaded for each size, and its empty twin ``bench_history_0``. For each size:

1. N finished jobs are loaded by COPY (``bench.history_load``): a tenth of them (the
   "day" the retention pass removes) finished just over the archive window ago.
2. Same work: rounds of ``demo.summary`` jobs asked for through ``jobs.request`` and
   drained by worker threads of this process, the loaded database and its empty twin
   taking turns each round, with the broker's own claim
   (``jobs.claiming.Claimer``) and ``run_claim``: jobs/s, and each claim statement's
   (``pgclaim.claim_next``) and each publish's (the executor's ``publish``) time.
3. The maintenance round (``jobs.dispatch.dispatch_once``) and, after the pass, the
   archive's look that finds nothing; table and index bytes of jobs, attempts, effects.
4. The retention pass: ``jobs.archive.archive`` of the day's jobs in a process of its
   own (as ``jobs_prune --archive`` runs) while the worker threads claim a steady
   stream; its wall time, its time in the database driver (statements and commits,
   round trips included), and the claim p99 during it against the seconds just before.

Printed: two lines per size and one line ``history 10M/0: throughput X.XX claim-p99 X.XX
publish-p99 X.XX retention-s X.X`` (the largest size against 0; retention-s is the pass's
database seconds at the largest size), then the issue's bar, each part ok or FAILS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bench import infra
from bench.history_load import Plan, current, empty, load, prepare, table_bytes, use_database
from jobs.testing import scratchdb


def parse_size(text: str) -> int:
    """``0``, ``2k``, ``100k``, ``1M``, ``10M`` or a plain number."""
    text = text.strip()
    scale = {"k": 1_000, "K": 1_000, "m": 1_000_000, "M": 1_000_000}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    return int(float(number) * scale)


def label(n: int) -> str:
    """The size as the issue writes it: 10M, 1M, 100k, 2k, 0 (else the number)."""
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1_000 and n % 1_000 == 0:
        return f"{n // 1_000}k"
    return str(n)


def window_days() -> float:
    """The archive window the pass uses: the shortest the engine allows, whole days."""
    from jobs import retention

    return float(math.ceil(retention.minimum_days()))


# --- the workers -----------------------------------------------------------------------


class Timings:
    """Per-call seconds of the claim statement and the publish, by phase."""

    def __init__(self) -> None:
        self.phase = "off"
        self.claim: dict[str, list[float]] = {}
        self.publish: dict[str, list[float]] = {}
        self.ran = 0

    def add(self, which: dict[str, list[float]], seconds: float) -> None:
        if self.phase != "off":
            which.setdefault(self.phase, []).append(seconds)  # list.append: thread-safe


@contextlib.contextmanager
def timed_calls(timings: Timings) -> Iterator[None]:
    """Time every claim statement and every publish this process makes (the engine's own
    functions, wrapped here for the bench only)."""
    from jobs.executors import pgclaim, postgres

    claim_next, publish = pgclaim.claim_next, postgres.publish

    def timed_claim(*args, **kwargs):
        t = time.perf_counter()
        try:
            return claim_next(*args, **kwargs)
        finally:
            timings.add(timings.claim, time.perf_counter() - t)

    def timed_publish(plan):
        t = time.perf_counter()
        try:
            return publish(plan)
        finally:
            timings.add(timings.publish, time.perf_counter() - t)

    pgclaim.claim_next, postgres.publish = timed_claim, timed_publish
    try:
        yield
    finally:
        pgclaim.claim_next, postgres.publish = claim_next, publish


def _worker(name: str, timings: Timings, stop: threading.Event, until_empty: bool) -> None:
    """One worker: claim the default queue's next due job (or send) and run it, as a
    cluster's worker keeps going; until the queue is empty or ``stop`` is set."""
    from django.db import connections

    from jobs.claiming import Claimer, Leased
    from jobs.delivery import runner
    from jobs.tasks import _send_leased

    claimer = Claimer(["default"])
    owner = f"bench-history:{os.getpid()}:{name}"
    try:
        while not stop.is_set():
            claim = claimer.next(owner)
            if claim is None:
                if until_empty:
                    return
                time.sleep(0.01)
                continue
            if isinstance(claim, Leased):
                _send_leased(claim.effect.pk, claim.effect.lease_owner, claim.prior)
            else:
                runner.run_claim(claim, claim.job.lease_owner)
                timings.ran += 1
    finally:
        connections.close_all()


def _feeder(user_id: int, stop: threading.Event, keep: int = 100) -> None:
    """A steady stream: keeps at least ``keep`` jobs queued while the workers run."""
    from django.db import connections

    from bench import workloads
    from jobs.models import Job

    try:
        while not stop.is_set():
            if Job.objects.filter(state="queued").count() < keep:
                workloads.enqueue_summaries(keep, user_id)
            time.sleep(0.05)
    finally:
        connections.close_all()


def _start(targets: list[tuple[Callable, tuple]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=f, args=a, daemon=True) for f, a in targets]
    for t in threads:
        t.start()
    return threads


def same_work(user_id: int, *, n: int, rounds: int, workers: int, timings: Timings) -> list[float]:
    """``rounds`` runs of ``n`` demo.summary jobs drained by ``workers`` threads: jobs/s."""
    from bench import workloads

    rates = []
    for _ in range(rounds):
        workloads.enqueue_summaries(n, user_id)
        stop = threading.Event()
        timings.phase = "same work"
        t = time.perf_counter()
        threads = _start([(_worker, (f"w{k}", timings, stop, True)) for k in range(workers)])
        for th in threads:
            th.join()
        rates.append(n / (time.perf_counter() - t))
        timings.phase = "off"
    return rates


def maintenance_round_ms(repeat: int = 5) -> float:
    """Median ms of the maintenance round (its prune and archive held off: timed apart)."""
    from jobs import archive, dispatch, retention

    samples = []
    for _ in range(repeat):
        archive._archived_at = retention._pruned_at = time.monotonic()
        t = time.perf_counter()
        dispatch.dispatch_once()
        samples.append((time.perf_counter() - t) * 1000)
    return statistics.median(samples)


def archive_look_ms(days: float, repeat: int = 5) -> float:
    """Median ms of an archive pass of one batch at most: after a whole pass it finds
    nothing (what each round's archive costs); after a pass stopped at its budget, one
    batch of work."""
    from jobs import archive

    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        archive.archive(older_than_days=days, max_batches=1)
        samples.append((time.perf_counter() - t) * 1000)
    return statistics.median(samples)


def retention_pass(
    user_id: int, days: float, *, workers: int, before_s: float, budget: float, timings: Timings
) -> dict:
    """The archive pass in its own process while ``workers`` threads claim a steady
    stream: its figures, and the claims' times just before it and during it."""
    stop = threading.Event()
    threads = _start(
        [(_feeder, (user_id, stop))]
        + [(_worker, (f"r{k}", timings, stop, False)) for k in range(workers)]
    )
    ran_before = timings.ran  # set again when the pass starts
    try:
        time.sleep(min(1.0, before_s))  # the stream settles
        timings.phase = "before"
        time.sleep(before_s)
        child = ["-m", "bench.history", "retention", "--days", str(days), "--budget", str(budget)]
        proc = subprocess.Popen(
            [sys.executable, *child],
            cwd=infra.ROOT,
            env=infra.child_env(BENCH_DB=current()),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        result: dict = {}
        for line in proc.stdout:
            if line.startswith("archiving"):
                timings.phase = "during"
                ran_before = timings.ran
            elif line.startswith("{"):
                timings.phase = "off"
                result = json.loads(line)
        if proc.wait() != 0 or not result:
            raise RuntimeError(f"the retention pass failed (exit {proc.returncode})")
    finally:
        timings.phase = "off"
        stop.set()
        for th in threads:
            th.join()
    result["ran_meanwhile"] = timings.ran - ran_before
    return result


def _retention_child(days: float, budget: float) -> None:
    """``python -m bench.history retention --days D``: one archive pass (the default
    batches, as ``jobs_prune --archive``), timed in the driver, stopped between batches
    once ``budget`` seconds have passed; prints JSON."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    from django.db import connection

    from jobs import archive

    spent = [0.0]
    connection.ensure_connection()
    commit = connection._commit

    def timed_commit():
        t = time.perf_counter()
        try:
            return commit()
        finally:
            spent[0] += time.perf_counter() - t

    def timed_execute(execute, sql, params, many, context):
        t = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            spent[0] += time.perf_counter() - t

    connection._commit = timed_commit
    print("archiving", flush=True)
    jobs = effects = batches = 0
    stopped = False
    started = time.monotonic()
    with connection.execute_wrapper(timed_execute):
        # The pass's own loop, ten batches a call, so that a pass longer than the budget
        # can be stopped between batches (and said so).
        while True:
            done = archive.archive(older_than_days=days, max_batches=10)
            jobs, effects, batches = (
                jobs + done.jobs,
                effects + done.effects,
                batches + done.batches,
            )
            if done.batches < 10 or done.jobs < 10 * archive.BATCH:
                break
            if time.monotonic() - started > budget:
                stopped = True
                break
    figures = {"jobs": jobs, "effects": effects, "batches": batches, "stopped": stopped}
    figures.update(wall_s=time.monotonic() - started, db_s=spent[0])
    print(json.dumps(figures), flush=True)


# --- one size, all sizes, the lines ------------------------------------------------------


@dataclass
class Options:
    n: int = 600  # same-work jobs a round
    rounds: int = 3
    workers: int = 2
    before_s: float = 8.0  # the claims timed just before the retention pass
    retention_budget_s: float = 600.0  # a longer pass is stopped between batches (and said)


def _paired_same_work(
    user_ids: dict[str, int], opts: Options, dbs: tuple[str, ...]
) -> dict[str, tuple[list[float], Timings]]:
    """Same-work rounds in each of ``dbs`` in turn (the order swapped every other round),
    so that the machine's drift weighs on both sides of a ratio alike."""
    out = {db: ([], Timings()) for db in dbs}
    for db in dbs:
        with use_database(db):
            warm = min(50, opts.n)  # first statements, caches: not timed
            same_work(user_ids[db], n=warm, rounds=1, workers=opts.workers, timings=Timings())
    for r in range(opts.rounds):
        for db in dbs if r % 2 == 0 else dbs[::-1]:
            rates, timings = out[db]
            with use_database(db), timed_calls(timings):
                rates += same_work(
                    user_ids[db], n=opts.n, rounds=1, workers=opts.workers, timings=timings
                )
    return out


def _ms(timings: Timings) -> dict[str, list[float]]:
    return {
        f"{which}_{phase}": [s * 1000 for s in samples]
        for which, by_phase in (("claim", timings.claim), ("publish", timings.publish))
        for phase, samples in by_phase.items()
    }


def measure(
    size: int, user_ids: dict[str, int], opts: Options, progress: Callable[[str], None]
) -> dict:
    """Measure ``size`` finished jobs (module doc): size 0 in the empty database, any other
    size loaded into ``HISTORY_DB``, its same-work rounds paired with the empty one's."""
    base, db = infra.HISTORY_BASE_DB, infra.HISTORY_DB if size else infra.HISTORY_BASE_DB
    days = window_days()
    plan = Plan(size, days)
    load_s = 0.0
    with use_database(base):
        empty()  # the same-work rounds of the sizes before
    if size:
        with use_database(db):
            empty()
            load_s = load(plan, progress)
    paired = _paired_same_work(user_ids, opts, (base, db) if size else (base,))
    rates, timings = paired[db]
    with use_database(db):
        sizes = table_bytes()
        round_ms = maintenance_round_ms()
        progress(
            f"history {label(size)}: {statistics.median(rates):.1f} jobs/s; retention pass of "
            f"{plan.day:,} jobs with {opts.workers} workers running"
        )
        passed = dict.fromkeys(("jobs", "effects", "batches", "ran_meanwhile"), 0)
        passed.update(wall_s=0.0, db_s=0.0, skipped=True)  # nothing to archive
        with timed_calls(timings):
            passed = (
                passed
                if not plan.day
                else retention_pass(
                    user_ids[db],
                    days,
                    workers=opts.workers,
                    before_s=opts.before_s,
                    budget=opts.retention_budget_s,
                    timings=timings,
                )
            )
        look_ms = archive_look_ms(days, repeat=1 if passed.get("stopped") else 5)
    base_rates, base_timings = paired[base]
    return {
        "size": size,
        "day": plan.day,
        "window_days": days,
        "load_s": load_s,
        "rates": rates,
        "rate": statistics.median(rates),
        # Beside it, round by round: the empty database's rates and times.
        "base_rates": base_rates,
        "ratio": statistics.median(a / b for a, b in zip(rates, base_rates, strict=True)),
        "bytes": sizes,
        "maintenance_ms": round_ms,
        "archive_look_ms": look_ms,
        "retention": passed,
        "ms": _ms(timings),
        "base_ms": _ms(base_timings),
    }


def run(
    sizes: list[int], opts: Options | None = None, progress: Callable[[str], None] = print
) -> dict:
    """Every size in turn (``HISTORY_DB`` emptied and loaded for each, beside its empty twin
    ``HISTORY_BASE_DB``; both dropped at the end): figures and lines."""
    opts = opts or Options()
    per = []
    dbs = (infra.HISTORY_BASE_DB, infra.HISTORY_DB)
    try:
        for db in dbs:
            infra.drop_database(db)
        infra.ensure_database(dbs[0])
        with use_database(dbs[0]):
            user_id = prepare()
        # The twin is a copy of the migrated database (a migrate costs seconds).
        with scratchdb.admin_connection(infra.server_url()) as conn:
            conn.execute(f'CREATE DATABASE "{dbs[1]}" TEMPLATE "{dbs[0]}"')
        user_ids = dict.fromkeys(dbs, user_id)
        for size in sizes:
            per.append(measure(size, user_ids, opts, progress))
    finally:
        for db in dbs:
            infra.drop_database(db)
    detail, summary = lines(per)
    return {"sizes": per, "options": vars(opts), "lines": detail, "summary": summary}


def _p(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``bench.latency.pct``, which needs Django set up)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}" if n >= 2**20 else f"{n / 2**20:.2f}"


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _same_work_line(r: dict) -> str:
    c, p = r["ms"].get("claim_same work", []), r["ms"].get("publish_same work", [])
    b = "; ".join(f"{t} {_mib(total)}/{_mib(idx)}" for t, (total, idx) in r["bytes"].items())
    beside = ""
    if r["size"]:
        bc, bp = r["base_ms"].get("claim_same work", []), r["base_ms"].get("publish_same work", [])
        beside = (
            f" [the empty database beside it: {statistics.median(r['base_rates']):.1f} jobs/s, "
            f"claim p50/p99 {_p(bc, 50):.2f}/{_p(bc, 99):.2f} ms, publish p50/p99 "
            f"{_p(bp, 50):.2f}/{_p(bp, 99):.2f} ms]"
        )
    # After a pass stopped at its budget, the "look" still finds a batch to archive.
    look = "archive batch" if r["retention"].get("stopped") else "archive look"
    return (
        f"history {label(r['size'])}: load {r['load_s']:.0f} s; same work "
        f"{r['rate']:.1f} jobs/s (rounds {'/'.join(f'{x:.0f}' for x in r['rates'])}); "
        f"claim p50/p99 {_p(c, 50):.2f}/{_p(c, 99):.2f} ms (n={len(c)}); publish p50/p99 "
        f"{_p(p, 50):.2f}/{_p(p, 99):.2f} ms (n={len(p)}){beside}; maintenance round "
        f"{r['maintenance_ms']:.1f} ms, {look} {r['archive_look_ms']:.1f} ms; "
        f"MiB total/indexes {b}"
    )


def _retention_line(r: dict) -> str:
    ret = r["retention"]
    if ret.get("skipped"):
        return f"history {label(r['size'])} retention: nothing to archive, no pass run"
    before, during = r["ms"].get("claim_before", []), r["ms"].get("claim_during", [])
    stopped = ""
    if ret.get("stopped"):
        stopped = (
            f" (STOPPED at the budget: {ret['jobs']:,} of the day's {r['day']:,} jobs; at "
            f"this pace the whole day would take {ret['db_s'] * r['day'] / ret['jobs']:.0f} s)"
        )
    return (
        f"history {label(r['size'])} retention: {ret['jobs']:,} jobs ({ret['effects']:,} "
        f"effects) archived in {ret['batches']} batches, {ret['wall_s']:.1f} s wall, "
        f"{ret['db_s']:.1f} s in the database{stopped}; claim p99 before {_p(before, 99):.2f} ms "
        f"(n={len(before)}), during {_p(during, 99):.2f} ms (n={len(during)}, "
        f"{_ratio(_p(during, 99), _p(before, 99)):.2f}x); {ret['ran_meanwhile']} jobs ran "
        f"meanwhile (window {r['window_days']:g} days)"
    )


def lines(per: list[dict]) -> tuple[list[str], list[str]]:
    """Two lines a size; then the one line of the largest size against the empty database
    measured beside it (paired rounds), and the issue's bar."""
    out = [line for r in per for line in (_same_work_line(r), _retention_line(r))]
    top = max(per, key=lambda r: r["size"], default=None)
    if top is None or not top["size"]:
        return out, []

    def p99(ms: dict, key: str) -> float:
        return _p(ms.get(key, []), 99)

    thr = top["ratio"]
    claim = _ratio(p99(top["ms"], "claim_same work"), p99(top["base_ms"], "claim_same work"))
    publish = _ratio(p99(top["ms"], "publish_same work"), p99(top["base_ms"], "publish_same work"))
    ret = top["retention"]
    during = _ratio(p99(top["ms"], "claim_during"), p99(top["ms"], "claim_before"))
    summary = [
        f"history {label(top['size'])}/0: throughput {thr:.2f} claim-p99 {claim:.2f} "
        f"publish-p99 {publish:.2f} retention-s {ret['db_s']:.1f}"
    ]

    def ok(good: bool) -> str:
        return "ok" if good else "FAILS"

    summary.append(
        f"history bar (issue 46, at {label(top['size'])}): throughput {thr:.2f} >= 0.90 "
        f"{ok(thr >= 0.90)}; claim-p99 {claim:.2f} <= 1.2 {ok(claim <= 1.2)}; publish-p99 "
        f"{publish:.2f} <= 1.2 {ok(publish <= 1.2)}; retention of {ret['jobs']:,} jobs"
        f"{' (stopped, of ' + format(top['day'], ',') + ')' if ret.get('stopped') else ''} in "
        f"{ret['db_s']:.1f} s of database time <= 5 s {ok(ret['db_s'] <= 5.0)} (the bar "
        f"names 1M); claim p99 during it {during:.2f}x <= 2x {ok(during <= 2.0)}"
    )
    return out, summary


def main(argv: list[str] | None = None) -> None:
    """The retention pass's own process (``retention --days D``)."""
    parser = argparse.ArgumentParser(prog="python -m bench.history")
    parser.add_argument("what", choices=["retention"])
    parser.add_argument("--days", type=float, required=True)
    parser.add_argument("--budget", type=float, default=math.inf, help="seconds")
    args = parser.parse_args(argv)
    _retention_child(args.days, args.budget)


if __name__ == "__main__":
    main()
