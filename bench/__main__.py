"""``python -m bench`` (``make bench``): the price of exactly-once effects, in one run.

Sections, all sequential (the machine has 2 cores):

1. hot path: statements, round trips and commits of one delivery, its time
   split between the database driver and Python, and a cProfile by bucket;
2. throughput: bare django-q2 no-ops, the minimal kind ``demo.summary``, the
   permit report kind, and plain django-q2 tasks doing each kind's work
   without the engine (``bench.plain``), interleaved over several rounds under
   real ``manage.py qcluster`` workers with the production ``Q_CLUSTER``;
3. scaling and memory: 1 and 4 workers besides the rounds' 2;
4. latency: idle single jobs, in-app and webhook bursts of 83;
5. PDF render time;
6. ledger and claim lookups at 10k, 100k and 1M rows;
7. knobs (only when asked for, ``--sections knobs``): the fsync cost of the
   artifact write, and ``CONN_HEALTH_CHECKS`` on and off for the workers;
8. hosts: the same queue drained by 1, 2 and 3 worker "hosts" (qclusters with their
   own ``JOBS_HOST_NAME`` and ``TMPDIR``): throughput, CPU and commits per job;
9. s3: the artifact store's cost per artifact on moto's S3 server (loopback HTTP)
   against the filesystem store (``bench.hosts``);
10. broker: the engine's jobs on the jobs table against the same work as plain tasks on
    django-q2's ORM broker and on ``jobs.broker.PostgresBroker`` (LISTEN/NOTIFY): idle
    singles, a burst of 83, a quiet cluster's transactions/s (``bench.broker``);
11. scheduling: the claim's throughput with priorities and two queues in use against
    without, per executor, in process (``bench.scheduling``);
11b. fairshare: the claim's throughput with the fair share in use against without (in
    process per executor, and ``demo.summary`` end to end), and the starvation bound
    observed (``bench.fairshare``);
12. history (only when asked for, ``--sections history``): 0, 1M and 10M finished jobs
    loaded by COPY; same-work jobs/s, the claim's and the publish's p50/p99, the
    maintenance round, table bytes and the archive pass while workers run (issue 46,
    ``bench.history``; ``--history-sizes 0,100k`` for a quick run);
13. before -> after (only with ``--before REF``): REF's same-work ratios measured beside
    this tree's, each round both trees in turn (``bench.compare``).

Figures move 10-40% between runs on a shared machine; ratios measured in one
run (each round pairs the kinds back to back) hold much better. The summary
lines at the end are machine-readable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved throughput rounds")
    p.add_argument("--workers", type=int, default=None, help="default: Q_CLUSTER['workers']")
    p.add_argument("--n-bare", type=int, default=2000, help="no-op tasks per run")
    p.add_argument("--n-summary", type=int, default=None, help="default: sized to ~12 s a run")
    p.add_argument("--n-report", type=int, default=None, help="default: sized to ~12 s a run")
    p.add_argument(
        "--n-plain-minimal", type=int, default=None, help="default: the same N as demo.summary"
    )
    p.add_argument("--n-plain-report", type=int, default=None, help="default: N of reports")
    p.add_argument(
        "--sections",
        default="hotpath,throughput,flow,scaling,latency,broker,scheduling,fairshare,pdf,ledger,hosts,s3",
        help="comma-separated subset; add knobs for the fsync and CONN_HEALTH_CHECKS figures",
    )
    p.add_argument("--ledger-sizes", default="10000,100000,1000000")
    p.add_argument(
        "--history-sizes",
        default="0,1M,10M",
        help="finished jobs behind the history section's runs (0,2k,100k,1M,...)",
    )
    p.add_argument("--history-jobs", type=int, default=600, help="same-work jobs a round")
    p.add_argument(
        "--history-before",
        type=float,
        default=8.0,
        help="seconds of claims timed just before the retention pass",
    )
    p.add_argument(
        "--history-retention-budget",
        type=float,
        default=600.0,
        help="seconds after which the retention pass is stopped between batches (and said so)",
    )
    p.add_argument("--n-hosts", type=int, default=300, help="summary jobs per hosts run")
    p.add_argument("--n-store", type=int, default=100, help="artifacts per store in the s3 section")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, small N, no 1M")
    p.add_argument("--keep-ledger", action="store_true", help="keep the bench_ledger database")
    p.add_argument("--json", default="var/bench/results.json", help="where to write all figures")
    p.add_argument(
        "--before",
        action="append",
        default=[],
        metavar="REF",
        help="also measure REF's same-work ratios beside this tree's, in turn (bench.compare)",
    )
    return p.parse_args(argv)


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine() -> dict[str, str]:
    import django
    import psycopg
    from django.db import connection

    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    mem = next(
        ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if "MemTotal" in ln
    )
    from importlib.metadata import version

    with connection.cursor() as cur:
        cur.execute("SHOW server_version")
        pg = cur.fetchone()[0]
    load = os.getloadavg()
    return {
        "cpus": str(os.cpu_count()),
        "cpu": cpu,
        "memory": f"{int(mem) / 1024 / 1024:.1f} GiB",
        "python": platform.python_version(),
        "django": django.get_version(),
        "django-q2": version("django-q2"),
        "psycopg": psycopg.__version__,
        "postgresql": pg,
        "load at start": " ".join(f"{x:.1f}" for x in load),
    }


def _ms(x: float) -> str:
    """Milliseconds as printed: a tenth below 100 ms, where a bar (idle p50 <= 10 ms) is
    read; whole milliseconds above."""
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _round_to(x: float, step: int, lo: int, hi: int) -> int:
    return int(max(lo, min(hi, round(x / step) * step)))


def main(argv=None) -> int:
    args = _args(argv)
    started = time.monotonic()
    from bench import infra

    sys.path.insert(0, str(infra.ROOT))
    if args.quick:
        args.rounds = 1
        args.n_bare = min(args.n_bare, 1000)
        args.ledger_sizes = "10000,100000"
    sections = set(args.sections.split(","))
    infra.start_django()
    from django.conf import settings

    from bench import e2e, hotpath, workloads

    workers = args.workers or settings.Q_CLUSTER["workers"]
    user_id = 0
    if sections - {"history"}:  # the history section makes and seeds its own database
        say(f"preparing {infra.E2E_DB} afresh (migrate, seed_demo)")
        user_id = workloads.prepare_database()
    results: dict = {"machine": machine(), "q_cluster": _q_cluster(settings), "args": vars(args)}
    say("machine: " + ", ".join(f"{k} {v}" for k, v in results["machine"].items()))

    per_job_ms = report_ms = None
    if "hotpath" in sections:
        infra.reset_run_tables()
        traces = hotpath.capture(user_id)
        report_trace, report_ms = hotpath.capture_report()
        traces["report"] = report_trace
        split = hotpath.split(user_id, 150 if not args.quick else 60)
        buckets, top = hotpath.profile(user_id, 100 if not args.quick else 40)
        per_job_ms = split.wall_ms
        results["hotpath"] = {
            "traces": {
                k: {
                    "round_trips": t.round_trips,
                    "statements": t.statements,
                    "transactions": t.transactions,
                    "commits": t.commits,
                    "listing": t.listing(),
                }
                for k, t in traces.items()
            },
            "split": {
                "jobs": split.jobs,
                "wall_ms": split.wall_ms,
                "db_ms": split.db_ms,
                "python_ms": split.python_ms,
                "statements": split.statements,
                "commits": split.commits,
                "by_statement_ms": dict(split.per_statement.most_common()),
            },
            "profile_ms_per_job": buckets,
            "profile_top": top,
            "report_ms_in_process": report_ms,
        }
        say(
            f"hot path: {traces['run_delivery'].summary()}; {split.wall_ms:.1f} ms/job in "
            f"process ({split.db_ms:.1f} in the driver)"
        )

    pdf = None
    if "pdf" in sections:
        from bench import pdf as pdfbench

        pdf = pdfbench.run(rounds=4 if not args.quick else 1)
        results["pdf"] = vars(pdf)
        say(f"pdf: median {pdf.median_ms:.1f} ms, p95 {pdf.p95_ms:.1f} ms")

    # Size the engine's runs to ~12 s each from the in-process cost (shared machines vary;
    # without the hotpath section, today's typical cost). Each plain task runs the same N
    # as the engine's kind doing its work: the queue table then grows and is drained the
    # same way on both sides of a ratio (a longer run is slower per message: the broker
    # scans more dead rows of django_q_ormq, as autovacuum is off here).
    parallel = min(workers, os.cpu_count() or 2)
    est_summary = (per_job_ms or 8.0) * 1.6 / parallel
    n_summary = args.n_summary or _round_to(12_000 / est_summary, 100, 500, 3000)
    est_report = (report_ms or 20.0) * 1.6 / parallel
    n_report = args.n_report or _round_to(12_000 / est_report, 12, 60, 1200)
    if args.quick:
        n_summary, n_report = min(n_summary, 300), min(n_report, 60)
    n_plain_min = args.n_plain_minimal or n_summary
    n_plain_rep = args.n_plain_report or n_report
    if "throughput" in sections:
        from bench import plain

        infra.reset_run_tables()
        min_ms, rep_ms = plain.in_process_ms(user_id)
        results["plain_in_process_ms"] = {"minimal": min_ms, "report": rep_ms}
    sizes = {
        e2e.BARE: args.n_bare,
        e2e.PLAIN_MINIMAL: n_plain_min,
        e2e.PLAIN_MINIMAL_PG: n_plain_min,
        e2e.SUMMARY: n_summary,
        e2e.PLAIN_REPORT: n_plain_rep,
        e2e.PLAIN_REPORT_PG: n_plain_rep,
        e2e.REPORT: n_report,
    }
    results["n"] = sizes

    runs: list[e2e.Run] = []

    def measure(kind, w, r):
        run = e2e.run(kind, sizes[kind], w, user_id, round=r)
        runs.append(run)
        rss = max(run.drain.rss_kib or [0]) / 1024
        say(
            f"{e2e.LABELS[kind]:30} {w}w round {r}: {run.rate:7.1f} jobs/s "
            f"(n={run.n}, wall {run.drain.wall:.1f}s, worker RSS {rss:.0f} MiB"
            f"{'' if run.ok else ', CHECK FAILED ' + str(run.check)})"
        )
        return run

    if "throughput" in sections:
        # Each plain task runs right next to its engine kind (the same-work ratios pair
        # them, so a change of load between runs moves both); the pairs rotate and, every
        # other round, swap which of the two goes first.
        units = [
            [e2e.BARE],
            [e2e.PLAIN_MINIMAL, e2e.SUMMARY, e2e.PLAIN_MINIMAL_PG],
            [e2e.PLAIN_REPORT, e2e.REPORT, e2e.PLAIN_REPORT_PG],
        ]
        for r in range(1, args.rounds + 1):
            shift = (r - 1) % len(units)
            for unit in units[shift:] + units[:shift]:
                for kind in unit if r % 2 else unit[::-1]:
                    measure(kind, workers, r)
    if "flow" in sections:
        # Smaller runs than the throughput section's: three variants a round.
        results["flow"] = flow_cost(min(n_summary, 600), workers, user_id, args.rounds)
    if "scaling" in sections:
        for w in (1, 4):
            for kind in (e2e.BARE, e2e.SUMMARY):
                measure(kind, w, 0)
    results["runs"] = [
        {
            "kind": r.kind,
            "workers": r.workers,
            "round": r.round,
            "n": r.n,
            "rate": r.rate,
            "wall": r.drain.wall,
            "rss_kib": r.drain.rss_kib,
            "server_per_job": r.drain.server,
            "cpu_ms_per_job": r.drain.cpu_ms,
            "ok": r.ok,
            "check": r.check,
        }
        for r in runs
    ]

    if "knobs" in sections:
        from bench import knobs

        fs = knobs.fsync_cost(300 if not args.quick else 60)
        say(f"knobs: fsync cost measured on {fs['filesystem']}")
        results["knobs"] = {
            "fsync": fs,
            "conn_health_checks": knobs.health_checks(
                n_summary, workers, user_id, args.rounds, progress=say
            ),
        }

    if "latency" in sections:
        from bench import latency

        lat = latency.run(user_id, workers, singles=20 if not args.quick else 3, progress=say)
        results["latency"] = {
            k: {"label": s.label, "values_ms": s.values_ms, "note": s.note} for k, s in lat.items()
        }

    if "broker" in sections:
        from bench import broker

        singles, quiet = (5, 10.0) if args.quick else (20, 30.0)
        brokers = broker.run(user_id, workers, singles=singles, quiet=quiet, progress=say)
        results["brokers"] = broker.as_json(brokers)

    if "scheduling" in sections:
        from bench import scheduling

        n_claims, rounds = (400, 1) if args.quick else (1500, args.rounds)
        results["scheduling"] = scheduling.run(n_claims, rounds, progress=say)

    if "fairshare" in sections:
        from bench import fairshare

        n_claims, rounds = (400, 1) if args.quick else (1500, args.rounds)
        results["fairshare"] = fairshare.run(
            user_id,
            workers,
            n_claims=n_claims,
            n_e2e=min(n_summary, 1000),
            rounds=rounds,
            progress=say,
        )

    if "hosts" in sections:
        from bench import hosts

        n_hosts = min(args.n_hosts, 120) if args.quick else args.n_hosts
        results["hosts"] = [
            {**vars(r), "rate": r.rate} for r in hosts.run_hosts(user_id, n=n_hosts, progress=say)
        ]

    if "s3" in sections:
        from bench import hosts

        n_store = min(args.n_store, 30) if args.quick else args.n_store
        results["store_costs"] = hosts.run_store_costs(n=n_store, progress=say)

    if "ledger" in sections:
        from bench import ledger

        sizes_l = tuple(int(x) for x in args.ledger_sizes.split(","))
        timings, loads = ledger.run(sizes_l, repeat=150, progress=say)
        results["ledger"] = {
            "loads_s": loads,
            "timings": [vars(t) for t in timings],
        }
        if not args.keep_ledger:
            infra.drop_database(infra.LEDGER_DB)

    if "history" in sections:
        from bench import history

        sizes_h = [history.parse_size(x) for x in args.history_sizes.split(",")]
        opts = history.Options(
            n=args.history_jobs,
            rounds=args.rounds,
            before_s=args.history_before,
            retention_budget_s=args.history_retention_budget,
        )
        say(f"history: {', '.join(history.label(n) for n in sizes_h)} finished jobs")
        results["history"] = history.run(sizes_h, opts, progress=say)

    if args.before:
        from bench import compare

        say(f"before -> after: {', '.join(args.before)} beside this tree (bench.compare)")
        results["compare"] = compare.run(
            args.before,
            n_minimal=min(n_summary, 1500),
            n_report=min(n_report, 360),
            rounds=args.rounds,
            workers=workers,
        )

    results["wall_s"] = time.monotonic() - started
    text = report(results, workers)  # also adds the derived same-work figures to ``results``
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(text)
    for line in results.get("compare", {}).get("lines", []):
        print(line)
    return 0


FLOW_VARIANTS = {
    "no rule": {},
    "kind concurrency 10000 (never binds)": {"concurrency": 10000},
    "kind rate 100000/s (never binds)": {"rate": 100000, "period_seconds": 1.0},
}


def flow_cost(n: int, workers: int, user_id: int, rounds: int) -> list[dict]:
    """demo.summary drained with and without an active flow rule on its kind that never
    binds: the price of a rule on the claim (judged inside the claim's statement by
    ``jobs_flow_admits_v1``: the scope's lock and a count, or a take from the rate's row)."""
    from bench import e2e
    from jobs import flow, rules

    scope = rules.kind_scope("demo.summary")
    out = []
    for r in range(1, rounds + 1):
        order = list(FLOW_VARIANTS.items())
        for label, rule in order if r % 2 else order[::-1]:
            flow.delete_rule(scope, actor="bench")
            if rule:
                flow.set_rule(scope, actor="bench", **rule)
            try:
                run = e2e.run(e2e.SUMMARY, n, workers, user_id, round=r)
            finally:
                flow.delete_rule(scope, actor="bench")
            load = os.getloadavg()[0]
            say(
                f"flow: demo.summary, {label:38} round {r}: {run.rate:7.1f} jobs/s "
                f"(n={run.n}, load {load:.1f}{'' if run.ok else ', CHECK FAILED'})"
            )
            out.append({"variant": label, "round": r, "rate": run.rate, "ok": run.ok, "load": load})
    return out


def _flow_lines(rows: list[dict], workers: int) -> list[str]:
    if not rows:
        return []
    base = {r["round"]: r["rate"] for r in rows if r["variant"] == "no rule"}
    lines = ["", f"cost of an active flow rule that never binds (demo.summary, {workers} workers)"]
    for label in FLOW_VARIANTS:
        rates = [r["rate"] for r in rows if r["variant"] == label]
        ratios = [r["rate"] / base[r["round"]] for r in rows if r["variant"] == label]
        lines.append(
            f"  {label:40} median {_median(rates):7.1f} jobs/s  "
            f"({_median(ratios):.2f}x of no rule, per-round pairs)"
        )
    return lines


def _q_cluster(settings) -> dict:
    q = dict(settings.Q_CLUSTER)
    db = settings.DATABASES["default"]
    q["CONN_MAX_AGE"] = db.get("CONN_MAX_AGE")
    q["CONN_HEALTH_CHECKS"] = db.get("CONN_HEALTH_CHECKS")
    q["JOBS_LEASE_SECONDS"] = getattr(settings, "JOBS_LEASE_SECONDS", None)
    return q


# --- the printed report ----------------------------------------------------------------


def _same_work(res: dict, workers: int, rates, paired, xacts, cpu_totals) -> list[str]:
    """The engine against plain tasks doing the same work; also stored in ``res``."""
    from bench.e2e import (
        PLAIN_MINIMAL,
        PLAIN_MINIMAL_PG,
        PLAIN_REPORT,
        PLAIN_REPORT_PG,
        REPORT,
        SUMMARY,
    )

    plain_min, plain_rep = (_median(rates(k, workers)) for k in (PLAIN_MINIMAL, PLAIN_REPORT))
    if plain_min != plain_min and plain_rep != plain_rep:
        return []
    nan = float("nan")
    figures = {
        "plain_minimal_jobs_s": plain_min,
        "plain_report_jobs_s": plain_rep,
        "ratio_minimal": paired(SUMMARY, PLAIN_MINIMAL),
        "ratio_report": paired(REPORT, PLAIN_REPORT),
        "plain_minimal_pg_jobs_s": _median(rates(PLAIN_MINIMAL_PG, workers)),
        "plain_report_pg_jobs_s": _median(rates(PLAIN_REPORT_PG, workers)),
        "ratio_minimal_pg": paired(SUMMARY, PLAIN_MINIMAL_PG),
        "ratio_report_pg": paired(REPORT, PLAIN_REPORT_PG),
        "cpu_ms_plain_minimal": cpu_totals.get(PLAIN_MINIMAL, nan),
        "cpu_ms_plain_report": cpu_totals.get(PLAIN_REPORT, nan),
        "cpu_ms_above_minimal": cpu_totals.get(SUMMARY, nan) - cpu_totals.get(PLAIN_MINIMAL, nan),
        "cpu_ms_above_report": cpu_totals.get(REPORT, nan) - cpu_totals.get(PLAIN_REPORT, nan),
    }
    res["same_work"] = figures
    n_rounds = len(rates(PLAIN_MINIMAL, workers))
    return [
        f"throughput of plain django-q2 tasks doing the same work ({workers} workers, median of "
        f"{n_rounds} interleaved rounds): minimal's work {plain_min:.1f} jobs/s, "
        f"report's work {plain_rep:.1f} jobs/s",
        f"ratio same-work minimal: {figures['ratio_minimal']:.2f}",
        f"ratio same-work report: {figures['ratio_report']:.2f}",
        "the same with the plain tasks on the PostgreSQL broker: minimal's work "
        f"{figures['plain_minimal_pg_jobs_s']:.1f} jobs/s, report's work "
        f"{figures['plain_report_pg_jobs_s']:.1f} jobs/s; ratio same-work minimal "
        f"{figures['ratio_minimal_pg']:.2f}, report {figures['ratio_report_pg']:.2f}",
        "CPU above same-work plain task, ms per job: "
        f"minimal {figures['cpu_ms_above_minimal']:+.1f}, "
        f"report {figures['cpu_ms_above_report']:+.1f}",
        "same-work plain tasks, per message: CPU (all our processes) "
        f"minimal {figures['cpu_ms_plain_minimal']:.1f} ms, report "
        f"{figures['cpu_ms_plain_report']:.1f} ms; server transactions minimal "
        f"{xacts(PLAIN_MINIMAL):.1f}, report {xacts(PLAIN_REPORT):.1f}",
    ]


def _knob_lines(knob: dict) -> list[str]:
    out = []
    fs = knob.get("fsync")
    if fs:
        for payload, by in fs["median_us"].items():
            out.append(
                f"fsync in the artifact write, {payload}, median µs of {fs['writes']} "
                f"({fs['filesystem']}): " + ", ".join(f"{v} {us:.0f}" for v, us in by.items())
            )
    hc = knob.get("conn_health_checks")
    if hc and hc["runs"]:
        parts = []
        for setting in dict.fromkeys(r["setting"] for r in hc["runs"]):
            rs = [r for r in hc["runs"] if r["setting"] == setting]
            rate = _median([r["rate"] for r in rs])
            cpu = _median([sum(r["cpu_ms_per_job"].values()) for r in rs])
            xa = _median([r["server_per_job"].get("xact_commit", float("nan")) for r in rs])
            bad = "" if all(r["ok"] for r in rs) else " (CHECK FAILED)"
            parts.append(
                f"{setting} {rate:.1f} jobs/s, CPU {cpu:.1f} ms/job, {xa:.1f} xacts/job{bad}"
            )
        out.append(
            f"CONN_HEALTH_CHECKS for the workers, demo.summary ({hc['workers']} workers, median "
            f"of {len(hc['runs']) // 2} rounds): " + "; ".join(parts)
        )
    return out


def _median(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def report(res: dict, workers: int) -> str:
    from bench.e2e import BARE, ENGINE, LABELS, REPORT, SUMMARY
    from bench.latency import pct

    lines = ["", "=" * 100, "make bench: the price of exactly-once effects (PostgreSQL)", "=" * 100]
    m = res["machine"]
    lines.append(
        f"machine: {m['cpus']} CPUs ({m['cpu']}), {m['memory']}; load at start {m['load at start']}"
    )
    lines.append(
        f"versions: Python {m['python']}, Django {m['django']}, django-q2 {m['django-q2']}, "
        f"psycopg {m['psycopg']}, PostgreSQL {m['postgresql']}"
    )
    q = res["q_cluster"]
    lines.append(
        "Q_CLUSTER: "
        + ", ".join(
            f"{k}={q.get(k)}"
            for k in ("workers", "timeout", "retry", "save_limit", "poll", "bulk", "max_attempts")
        )
        + f"; CONN_MAX_AGE={q['CONN_MAX_AGE']}, CONN_HEALTH_CHECKS={q['CONN_HEALTH_CHECKS']}, "
        f"lease={q['JOBS_LEASE_SECONDS']}s"
    )

    runs = res.get("runs", [])
    summary_lines = []
    if runs:
        lines += ["", "runs (each: empty tables, N messages enqueued, then a cluster drains them)"]
        lines.append(
            f"  {'kind':30} {'workers':>7} {'round':>5} {'N':>5} {'jobs/s':>8} {'wall s':>7} "
            f"{'RSS MiB':>8} {'xacts/job':>9} {'job upd/HOT':>12}  check"
        )
        for r in runs:
            s = r["server_per_job"]
            upd = s.get("jobs_job.upd", 0)
            hot = s.get("jobs_job.hot", 0)
            lines.append(
                f"  {LABELS[r['kind']]:30} {r['workers']:>7} {r['round'] or '-':>5} {r['n']:>5} "
                f"{r['rate']:>8.1f} {r['wall']:>7.1f} {max(r['rss_kib'] or [0]) / 1024:>8.0f} "
                f"{s.get('xact_commit', float('nan')):>9.1f} "
                f"{(f'{upd:.1f}/{hot:.1f}' if r['kind'] in ENGINE else '-'):>12}  "
                f"{'ok' if r['ok'] else 'FAILED ' + json.dumps(r['check'])}"
            )

        def rates(kind, w, rounds_only=True):
            return [
                r["rate"]
                for r in runs
                if r["kind"] == kind and r["workers"] == w and (r["round"] or not rounds_only)
            ]

        def paired(a, b):
            """Median of per-round ratios a/b (the kinds ran back to back in each round)."""
            by = {}
            for r in runs:
                if r["workers"] == workers and r["round"]:
                    by.setdefault(r["round"], {})[r["kind"]] = r["rate"]
            return _median([v[a] / v[b] for v in by.values() if a in v and b in v])

        roles = ["workers", "postgres backends", "pusher", "monitor", "sentinel"]
        lines += [
            "",
            f"CPU per message by process ({workers} workers, median of the rounds; "
            "/proc utime+stime from first to last acknowledgement; ms)",
            f"  {'kind':30} " + " ".join(f"{r:>17}" for r in roles) + f" {'total':>8}",
        ]
        cpu_totals = {}
        for kind in LABELS:
            per = [
                r["cpu_ms_per_job"]
                for r in runs
                if r["kind"] == kind and r["workers"] == workers and r["round"]
            ]
            if not per:
                continue
            med = {role: _median([p.get(role, float("nan")) for p in per]) for role in roles}
            cpu_totals[kind] = sum(med.values())
            lines.append(
                f"  {LABELS[kind]:30} "
                + " ".join(f"{med[r]:>17.2f}" for r in roles)
                + f" {cpu_totals[kind]:>8.2f}"
            )
        bare, summ, rep = (_median(rates(k, workers)) for k in (BARE, SUMMARY, REPORT))
        n_rounds = len(rates(BARE, workers))
        summary_lines.append(
            f"throughput ({workers} workers, median of {n_rounds} interleaved rounds): "
            f"bare django-q2 no-op {bare:.1f} jobs/s, demo.summary {summ:.1f} jobs/s, "
            f"permits.report {rep:.1f} jobs/s"
        )
        summary_lines.append(f"ratio end-to-end/bare-django-q2: {paired(SUMMARY, BARE):.2f}")
        summary_lines.append(f"ratio permits.report/demo.summary: {paired(REPORT, SUMMARY):.2f}")
        sx = [r["server_per_job"] for r in runs if r["workers"] == workers and r["round"]]

        def xacts(kind):
            return _median(
                [
                    r["server_per_job"].get("xact_commit", float("nan"))
                    for r in runs
                    if r["kind"] == kind and r["workers"] == workers and r["round"]
                ]
            )

        if BARE in cpu_totals and SUMMARY in cpu_totals:
            summary_lines.append(
                f"CPU per message, all our processes: bare {cpu_totals[BARE]:.1f} ms, "
                f"demo.summary {cpu_totals[SUMMARY]:.1f} ms, permits.report "
                f"{cpu_totals.get(REPORT, float('nan')):.1f} ms (CPU ratio bare/summary "
                f"{cpu_totals[BARE] / cpu_totals[SUMMARY]:.2f})"
            )
        if sx:
            summary_lines.append(
                "server transactions per message (pg_stat_database, all processes): "
                f"bare {xacts(BARE):.1f}, demo.summary {xacts(SUMMARY):.1f}, "
                f"permits.report {xacts(REPORT):.1f}"
            )
        same_work = _same_work(res, workers, rates, paired, xacts, cpu_totals)
        summary_lines += same_work
        scale = []
        for kind in (SUMMARY, BARE):
            per_w = [_median(rates(kind, w, rounds_only=False)) for w in (1, 2, 4)]
            scale.append(f"{LABELS[kind].split(' (')[0]} " + "/".join(f"{x:.1f}" for x in per_w))
        summary_lines.append("scaling jobs/s at 1/2/4 workers: " + "; ".join(scale))
        rss = []
        for kind in (SUMMARY, REPORT, BARE):
            vals = [v for r in runs if r["kind"] == kind for v in r["rss_kib"]]
            if vals:
                rss.append(f"{LABELS[kind].split(' (')[0]} {max(vals) / 1024:.0f}")
        summary_lines.append("peak RSS per worker process (VmHWM, MiB): " + ", ".join(rss))

    hp = res.get("hotpath")
    if hp:
        t = hp["traces"]
        lines += ["", "hot path of the minimal kind (CaptureQueriesContext; BEGIN/COMMIT count)"]
        for key in ("request_job", "run_delivery", "duplicate", "report"):
            tr = t[key]
            lines.append(
                f"  {key:14} {tr['round_trips']:>3} round trips = {tr['statements']} statements "
                f"+ {tr['transactions']} BEGIN/COMMIT pairs (+ savepoints); {tr['commits']} commits"
            )
        lines.append("  run_delivery, statement by statement:")
        lines += ["    " + s for s in t["run_delivery"]["listing"]]
        lines.append("  run_delivery of permits.report (PDF, reviewers via django-guardian):")
        lines += ["    " + s for s in t["report"]["listing"]]
        sp = hp["split"]
        lines.append(
            f"  in one process, {sp['jobs']} deliveries back to back: {sp['wall_ms']:.1f} ms/job = "
            f"{sp['db_ms']:.1f} ms in the driver (statements, commits) + {sp['python_ms']:.1f} ms "
            "Python"
        )
        lines.append("  driver time by statement (ms/job):")
        for k, v in list(sp["by_statement_ms"].items())[:8]:
            lines.append(f"    {v:6.2f}  {k}")
        lines.append("  cProfile, ms/job by where the time went (profiler overhead included):")
        for label, ms in hp["profile_ms_per_job"]:
            lines.append(f"    {ms:7.2f}  {label}")
        summary_lines.append(
            f"db cost per job (run_delivery of demo.summary): {t['run_delivery']['round_trips']} "
            f"queries ({t['run_delivery']['statements']} statements, "
            f"{t['run_delivery']['transactions']} transactions), "
            f"{t['run_delivery']['commits']} commits; "
            f"request_job {t['request_job']['round_trips']} queries, "
            f"{t['request_job']['commits']} commit; duplicate delivery "
            f"{t['duplicate']['round_trips']} queries, {t['duplicate']['commits']} commit"
        )

    lat = res.get("latency")
    if lat:
        lines += ["", "latency (ms; enqueue commit → the worker's own timestamp)"]
        for key in (
            "idle",
            "inapp_succeeded",
            "inapp_notice",
            "webhook_succeeded",
            "webhook_notice",
        ):
            s = lat.get(key)
            if not s:
                continue
            v = s["values_ms"]
            if v:
                lines.append(
                    f"  {s['label']:48} p50 {_ms(pct(v, 50)):>7}  p95 {_ms(pct(v, 95)):>7}  "
                    f"p99 {_ms(pct(v, 99)):>7}  (n={len(v)})"
                )
            else:
                lines.append(f"  {s['label']:48} not measured: {s['note']}")

        def trio(key):
            v = lat.get(key, {}).get("values_ms") or []
            return "/".join(_ms(pct(v, p)) for p in (50, 95, 99)) if v else "n/a"

        summary_lines.append(
            f"latency p50/p95/p99 ms, burst of 83: enqueue→succeeded {trio('inapp_succeeded')}, "
            f"enqueue→in-app notice {trio('inapp_notice')}; webhook (stand-in provider on "
            f"loopback): enqueue→succeeded {trio('webhook_succeeded')}, enqueue→notice "
            f"{trio('webhook_notice')}; idle single job {trio('idle')} "
            f"(poll {res['q_cluster'].get('poll')} s)"
        )

    if res.get("pdf"):
        p = res["pdf"]
        summary_lines.append(
            f"pdf render (permits.reports.render_report): median {p['median_ms']:.1f} ms, "
            f"p95 {p['p95_ms']:.1f} ms (n={p['renders']}, {p['size_bytes'] / 1024:.1f} KiB)"
        )

    led = res.get("ledger")
    if led:
        timings = led["timings"]
        sizes = sorted({t["rows"] for t in timings})
        lines += [
            "",
            "ledger and claim lookups by table size (median µs; server = EXPLAIN ANALYZE "
            "execution, orm = round trip through the ORM from this process)",
        ]
        lines.append(
            f"  {'lookup':40} "
            + " ".join(f"{f'{s:,} server':>14} {'orm':>7}" for s in sizes)
            + "  plan at the largest size"
        )
        names = list(dict.fromkeys(t["name"] for t in timings))
        flat = []
        for name in names:
            row = {t["rows"]: t for t in timings if t["name"] == name}
            cells = " ".join(
                f"{row[s]['server_us']:>14.0f} {row[s]['orm_us']:>7.0f}" for s in sizes
            )
            lines.append(f"  {name:40} {cells}  {row[sizes[-1]]['plan']}")
            first, last = row[sizes[0]], row[sizes[-1]]
            base = first["server_us"] if first["server_us"] == first["server_us"] else None
            if base:
                flat.append(
                    f"{name.split(': ', 1)[1]} {first['server_us']:.0f}→{last['server_us']:.0f}"
                )
        loads = ", ".join(f"{int(k):,}: {v:.0f}s" for k, v in led["loads_s"].items())
        lines.append(f"  bulk load (COPY, indexes rebuilt): {loads}")
        seq = [t["name"] for t in timings if "Seq Scan" in t["plan"]]
        summary_lines.append(
            f"ledger scaling {sizes[0]:,}→{sizes[-1]:,} rows, server µs per lookup: "
            + "; ".join(flat)
            + ("; every plan an index scan" if not seq else f"; SEQ SCANS: {', '.join(seq)}")
        )

    knob = res.get("knobs")
    if knob:
        lines += ["", "knobs (figures only)"]
        knob_lines = _knob_lines(knob)
        lines += ["  " + ln for ln in knob_lines]
        summary_lines += knob_lines

    flow_lines = _flow_lines(res.get("flow", []), workers)
    lines += flow_lines
    summary_lines += [ln.strip() for ln in flow_lines[2:]]
    from bench import broker as broker_bench

    broker_lines, broker_summary = broker_bench.report_lines(
        res.get("brokers", {}), res["q_cluster"].get("poll")
    )
    lines += broker_lines
    summary_lines += broker_summary
    from bench import scheduling as scheduling_bench

    scheduling_lines, scheduling_summary = scheduling_bench.report_lines(res.get("scheduling"))
    lines += scheduling_lines
    summary_lines += scheduling_summary
    from bench import fairshare as fairshare_bench

    fairshare_lines, fairshare_summary = fairshare_bench.report_lines(res.get("fairshare"))
    lines += fairshare_lines
    summary_lines += fairshare_summary
    host_runs = res.get("hosts")
    if host_runs:
        lines += ["", "worker hosts on this machine (demo.summary, one qcluster per host)"]
        lines.append(
            f"  {'hosts':>5} {'workers':>7} {'N':>5} {'jobs/s':>8} {'CPU ms/job':>10} "
            f"{'workers':>7} {'cluster':>7} {'PG':>5} {'commits/job':>11} {'writes/job':>10} "
            f"{'job upd/job':>11} "
            f"{'queue upd/job':>13}  claims by host"
        )
        for r in host_runs:
            cpu = sum(r["cpu_ms"].values())
            lines.append(
                f"  {r['hosts']:>5} {r['hosts'] * r['workers_per_host']:>7} {r['n']:>5} "
                f"{r['rate']:8.1f} {cpu:10.1f} {r['cpu_ms'].get('workers', 0):7.1f} "
                f"{r['cpu_ms'].get('sentinel/monitor/pusher', 0):7.1f} "
                f"{r['cpu_ms'].get('postgres backends', 0):5.1f} "
                f"{r['server'].get('xact_commit', 0):11.2f} "
                f"{r['server'].get('xids', float('nan')):10.2f} "
                f"{r['server'].get('jobs_job.upd', 0):11.2f} "
                f"{r['server'].get('django_q_ormq.upd', 0):13.2f}  {r['claims_by_host']}"
                + ("" if r["ok"] else "  CHECK FAILED")
            )
        first, last = host_runs[0], host_runs[-1]
        summary_lines.append(
            f"hosts 1→{last['hosts']}: {first['rate']:.1f}→{last['rate']:.1f} jobs/s, CPU "
            f"{sum(first['cpu_ms'].values()):.1f}→{sum(last['cpu_ms'].values()):.1f} ms/job, "
            f"commits {first['server'].get('xact_commit', 0):.2f}→"
            f"{last['server'].get('xact_commit', 0):.2f}/job (of which writing, by transaction "
            f"ids: {first['server'].get('xids', float('nan')):.2f}→"
            f"{last['server'].get('xids', float('nan')):.2f}; the enqueue is one transaction "
            "for the whole queue)"
        )
    costs = res.get("store_costs")
    if costs:
        lines += ["", "artifact store cost per artifact (create exclusively, verified read)"]
        for c in costs:
            lines.append(
                f"  {c['store']:26} {c['size'] // 1024} KiB x {c['n']}: create "
                f"{c['create_ms_median']:.2f} ms (p95 {c['create_ms_p95']:.2f}), verified read "
                f"{c['read_ms_median']:.2f} ms (p95 {c['read_ms_p95']:.2f})"
            )
        summary_lines.append(
            "store per artifact: "
            + "; ".join(
                f"{c['store'].split()[0]} create {c['create_ms_median']:.2f} ms read "
                f"{c['read_ms_median']:.2f} ms"
                for c in costs
            )
        )

    hist = res.get("history")
    if hist:
        lines += ["", "history at scale (issue 46; bench.history)"]
        lines += ["  " + ln for ln in hist["lines"]]
        summary_lines += hist["summary"]  # the one line outside checks read, and the bar

    lines += ["", "-" * 100]
    lines += summary_lines
    lines.append(f"bench wall time: {res['wall_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
