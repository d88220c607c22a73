"""The fair share's cost on the claim and the starvation bound it keeps (issue 42, part 5).

Three figures, each with ``JOBS_FAIR_SHARE`` on against off, in one run:

1. in process, no workers (as ``bench.scheduling``): N due jobs claimed one by one by the
   next-job claim of each executor, the jobs stay running. Two workloads: jobs without
   a tenant (the minimal kind's case: the claim only probes for a second tenant) and
   jobs of four tenants interleaved (every claim contended: the fair pick and the
   charge run). Variants alternate within a round and swap order every other round;
   the figure is the median of the rounds;
2. end to end: ``demo.summary`` (no tenant) drained by a real qcluster with the setting
   on and off (``BENCH_FAIR_SHARE``, ``bench.settings``), alternating per round;
3. the starvation bound: tenant ``a`` floods the queue, then ``b`` and ``c`` ask for one
   job each while ``C`` threads claim (each its own connection, jobs finished at once):
   how many claims came between each request and its claim, against ``K = 2 x C``
   (docs/app/fairness.md, the bound). Without the fair order they wait behind the flood.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from django.db import connection, connections
from django.db.models import F
from django.db.models.functions import Now
from django.test.utils import override_settings
from django.utils import timezone

from bench import e2e
from jobs.models import Attempt, Job, TenantShare

KIND = "bench.fair"
SETTING = {"fair share on": True, "fair share off": False}
WORKLOADS = {"no tenant": ("",), "4 tenants": ("t1", "t2", "t3", "t4")}
FLOOD, ASK_AFTER = 1000, 20


def _clear() -> None:
    Attempt.objects.filter(job__kind=KIND).delete()
    Job.objects.filter(kind=KIND).delete()
    TenantShare.objects.all().delete()


def _prepare(tenants: tuple[str, ...], n: int, tag: str) -> None:
    _clear()
    due = timezone.now() - timedelta(seconds=5)
    rows = [
        Job(
            kind=KIND,
            subject_type=KIND,
            subject_id=f"{tag}-{i}",
            tenant_key=tenants[i % len(tenants)],
            next_attempt_at=due,
            created_at=due,
            updated_at=due,
        )
        for i in range(n)
    ]
    Job.objects.bulk_create(rows, batch_size=500)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")


def _claims_per_second(executor: str, n: int) -> float:
    from jobs.executors import ormclaim, pgclaim

    claims = pgclaim if executor == "postgres" else ormclaim
    # No tenant's bound may hold a job back: the claim's own cost, not the admission's.
    bound = n
    started = time.perf_counter()
    won = 0
    for _ in range(n):
        got = claims.claim_next("default", "bench-fair", lease=600.0, bound=bound)
        won += bool(got is not None and got.won)
    seconds = time.perf_counter() - started
    if won != n:
        raise RuntimeError(f"{executor}: {won} of {n} claims won")
    return n / seconds


def in_process(n: int, rounds: int, progress: Callable[[str], None] = print) -> dict:
    """Claims/s per executor, workload and setting (median of ``rounds``), and the ratios
    on / off."""
    runs = []
    for r in range(1, rounds + 1):
        for executor in ("postgres", "orm"):
            size = n if executor == "postgres" else n // 5  # the ORM claim is slower
            for workload, tenants in WORKLOADS.items():
                order = list(SETTING.items())
                for label, fair in order if r % 2 else order[::-1]:
                    _prepare(tenants, size, f"{r}-{executor}")
                    with override_settings(JOBS_FAIR_SHARE=fair, JOBS_TENANT_CONCURRENCY=size):
                        rate = _claims_per_second(executor, size)
                    runs.append(
                        {"round": r, "executor": executor, "workload": workload, "setting": label}
                        | {"claims": size, "rate": rate}
                    )
                    progress(
                        f"fairshare: round {r} {executor:8} {workload:9} {label:14} "
                        f"{rate:7.1f} claims/s"
                    )
    _clear()
    medians, ratios = {}, {}
    for executor in ("postgres", "orm"):
        for workload in WORKLOADS:
            for label in SETTING:
                key = (executor, workload, label)
                rates = [
                    x["rate"] for x in runs if (x["executor"], x["workload"], x["setting"]) == key
                ]
                medians["/".join(key)] = statistics.median(rates)
            on, off = (medians[f"{executor}/{workload}/{label}"] for label in SETTING)
            ratios[f"{executor}/{workload}"] = on / off
    return {"runs": runs, "median_claims_s": medians, "ratio_on_to_off": ratios}


def _drains(
    variants: dict[str, tuple[str, str]], n: int, workers: int, user_id: int, rounds: int, progress
) -> tuple[list[dict], dict[str, float]]:
    """Each variant (label: kind, ``BENCH_FAIR_SHARE``) drained by a real cluster, in turn
    each round (the order swapped every other round); the runs and each label's median."""
    runs = []
    order = list(variants.items())
    for r in range(1, rounds + 1):
        for label, (kind, fair) in order if r % 2 else order[::-1]:
            run = e2e.run(kind, n, workers, user_id, round=r, env={"BENCH_FAIR_SHARE": fair})
            runs.append({"round": r, "setting": label, "n": n, "rate": run.rate, "ok": run.ok})
            progress(
                f"fairshare: {e2e.LABELS[kind]}, {label} round {r}: {run.rate:7.1f} jobs/s"
                f"{'' if run.ok else ', CHECK FAILED ' + str(run.check)}"
            )
    medians = {
        label: statistics.median(x["rate"] for x in runs if x["setting"] == label)
        for label in variants
    }
    return runs, medians


def end_to_end(n: int, workers: int, user_id: int, rounds: int, progress=print) -> dict:
    """``demo.summary`` drained by a real cluster with the fair share on and off."""
    variants = {label: (e2e.SUMMARY, "1" if fair else "0") for label, fair in SETTING.items()}
    runs, medians = _drains(variants, n, workers, user_id, rounds, progress)
    on, off = medians.values()
    return {"workers": workers, "runs": runs, "median_jobs_s": medians, "ratio_on_to_off": on / off}


# In use: four tenants' jobs in 50 sequences, the fair share on; without: the same four
# tenants' jobs, no sequence, the fair share off (the claim takes the plain order).
IN_USE = {
    "in use": (e2e.SEQUENCED, "1"),
    "without": (e2e.TENANTS, "0"),
}


def in_use(n: int, workers: int, user_id: int, rounds: int, progress=print) -> dict:
    """Claim throughput end to end with the fair share and sequences in use against
    without (issue 42, part 5): ``demo.summary`` over four tenants."""
    runs, medians = _drains(IN_USE, n, workers, user_id, rounds, progress)
    used, without = medians.values()
    return {
        "workers": workers,
        "runs": runs,
        "median_jobs_s": medians,
        "ratio_in_use_to_without": used / without,
        "all_checked": all(x["ok"] for x in runs),
    }


def _flood(tenant: str, count: int) -> None:
    now = timezone.now()
    Job.objects.bulk_create(
        Job(
            kind=KIND,
            subject_type=KIND,
            subject_id=f"{tenant}-{i}",
            tenant_key=tenant,
            created_at=now,
            updated_at=now,
        )
        for i in range(count)
    )


def _claimer(order: list, lock: threading.Lock, stop: threading.Event, limit: int) -> None:
    from jobs.executors import pgclaim

    try:
        idle = 0
        while not stop.is_set() and idle < 200:
            got = pgclaim.claim_next(
                "default", threading.current_thread().name, lease=60.0, bound=10**6
            )
            if got is None or not got.won:
                idle += got is None
                time.sleep(0.002 if got is None else 0)
                continue
            with lock:
                order.append(got.job.tenant_key)
                if len(order) >= limit:
                    stop.set()
            Job.objects.filter(pk=got.job.pk).update(
                state=Job.State.SUCCEEDED, version=F("version") + 1, finished_at=Now()
            )
    finally:
        connections["default"].close()


def starvation(claimers: int, fair: bool) -> dict:
    """Tenant a floods; after ``ASK_AFTER`` claims b and c ask for one each: the claims
    between each request and its claim (None: not within the run's claims)."""
    _clear()
    _flood("a", FLOOD)
    k = 2 * claimers
    limit = ASK_AFTER + 3 * k + 40
    order: list[str] = []
    lock, stop = threading.Lock(), threading.Event()
    with override_settings(JOBS_FAIR_SHARE=fair):
        threads = [
            threading.Thread(
                target=_claimer, args=(order, lock, stop, limit), name=f"bench-fair-{i}"
            )
            for i in range(claimers)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(order) < ASK_AFTER and time.monotonic() < deadline:
            time.sleep(0.001)
        asked = {}
        for tenant in ("b", "c"):
            _flood(tenant, 1)
            asked[tenant] = len(order)
        for t in threads:
            t.join(120)
    seen = {}
    for tenant in ("b", "c"):
        at = next((i for i, t in enumerate(order) if t == tenant), None)
        seen[tenant] = None if at is None else at - asked[tenant]
    _clear()
    return {"fair": fair, "claimers": claimers, "K": k, "positions": seen, "claims": len(order)}


def run(
    user_id: int, workers: int, *, n_claims: int, n_e2e: int, rounds: int, progress=print
) -> dict:
    """The section's three figures (``make bench``'s ``fairshare``)."""
    out = {"in_process": in_process(n_claims, rounds, progress)}
    out["end_to_end"] = end_to_end(n_e2e, workers, user_id, rounds, progress)
    out["in_use"] = in_use(n_e2e, workers, user_id, rounds, progress)
    out["starvation"] = [starvation(2 * workers, fair) for fair in (True, False)]
    for s in out["starvation"]:
        progress(
            f"fairshare: starvation, {'fair' if s['fair'] else 'plain'} claim, {s['claimers']} "
            f"claimers, K={s['K']}: b at {s['positions']['b']}, c at {s['positions']['c']}"
        )
    return out


def report_lines(res: dict | None) -> tuple[list[str], list[str]]:
    """The section's lines and its summary lines."""
    if not res:
        return [], []
    lines = ["", "claim throughput with the fair share in use (JOBS_FAIR_SHARE on) against off"]
    for key, rate in res["in_process"]["median_claims_s"].items():
        lines.append(f"  in process {key:40} {rate:8.1f} claims/s (median)")
    e2e_res = res["end_to_end"]
    for label, rate in e2e_res["median_jobs_s"].items():
        lines.append(
            f"  demo.summary, {e2e_res['workers']} workers, {label:14} {rate:8.1f} jobs/s (median)"
        )
    used = res.get("in_use")
    if used:
        for label, rate in used["median_jobs_s"].items():
            lines.append(
                f"  demo.summary, 4 tenants, {used['workers']} workers, {label:8} {rate:8.1f} "
                "jobs/s (median; in use: 50 sequences and the fair share on)"
            )
    for s in res["starvation"]:
        pos = s["positions"]
        lines.append(
            f"  starvation: {'fair' if s['fair'] else 'plain'} claim, {s['claimers']} claimers, "
            f"a floods {FLOOD}: b claimed {pos['b']} and c {pos['c']} claims after asking "
            f"(K = {s['K']}; None: not within {s['claims']} claims)"
        )
    ratios = res["in_process"]["ratio_on_to_off"]
    summary = [
        "fair share on / off, claim throughput: "
        + ", ".join(f"{key} {ratio:.3f}" for key, ratio in ratios.items())
        + f"; demo.summary end to end {e2e_res['ratio_on_to_off']:.3f}"
    ]
    if used:
        summary.append(
            "claim throughput with the fair share and sequences in use / without, end to end "
            f"(4 tenants): {used['ratio_in_use_to_without']:.3f}"
            + ("" if used["all_checked"] else " (A RUN FAILED ITS CHECK)")
        )
    fair = next((s for s in res["starvation"] if s["fair"]), None)
    if fair:
        worst = max((p for p in fair["positions"].values() if p is not None), default=None)
        missing = any(p is None for p in fair["positions"].values())
        summary.append(
            f"fair share starvation bound: worst position {worst if not missing else 'None'} "
            f"against K = {fair['K']} ({fair['claimers']} claimers)"
        )
    return lines, summary
