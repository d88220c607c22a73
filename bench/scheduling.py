"""The claim's throughput with priorities and queues in use, against without (issue 30).

In this process, no workers: N due jobs are written at once, then claimed one by one
through each executor in message order (the named job's id), as deliveries would.
"plain": every job priority 0 in the ``default`` queue (each claim keeps its named
job). "priorities + queues": priorities spread over -10..10 and two queues, so most
claims take another job of the named job's queue (the swap, docs/app/scheduling.md).
Each claim is the executor's whole claim (the PostgreSQL statement, or the ORM claim's
transaction); the jobs stay running (nothing is published). Variants alternate within
each round and swap order every other round; the figure is the median of the rounds.
Apart from the timed runs, a few claims per executor and variant are traced for their
round trips per claim (``CaptureQueriesContext``: it slows them, so never timed).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

from django.utils import timezone

from jobs import conf, executors
from jobs.models import Attempt, Job

KIND = "bench.claim"
VARIANTS = ("plain", "priorities + queues")


def _prepare(variant: str, n: int, tag: str) -> list[int]:
    Attempt.objects.filter(job__kind=KIND).delete()
    Job.objects.filter(kind=KIND).delete()
    rng = random.Random(7)
    due = timezone.now() - timedelta(seconds=5)
    rows = []
    for i in range(n):
        mixed = variant != "plain"
        rows.append(
            Job(
                kind=KIND,
                subject_type="bench.claim",
                subject_id=f"{tag}-{i}",
                priority=rng.randint(-10, 10) if mixed else 0,
                queue=("reports" if i % 2 else "default") if mixed else "default",
                next_attempt_at=due,
                created_at=due,
                updated_at=due,
            )
        )
    Job.objects.bulk_create(rows, batch_size=500)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")
    return list(Job.objects.filter(kind=KIND).order_by("pk").values_list("pk", flat=True))


def _claim_all(executor: str, ids: list[int]) -> tuple[float, int, int]:
    """Seconds for claiming every id once; how many claims took another job; how many won."""
    chosen = executors.by_name(executor)
    bound = conf.tenant_concurrency()
    swapped = won = 0
    started = time.perf_counter()
    for pk in ids:
        got = chosen.claim(pk, "bench-claimer", lease=600.0, bound=bound)
        if got.won:
            won += 1
            swapped += got.job.pk != pk
    return time.perf_counter() - started, swapped, won


def _queries_per_claim(executor: str, variant: str, n: int = 40) -> float:
    """Round trips per claim over ``n`` claims of ``variant`` (traced, not timed)."""
    from django.db import connection, reset_queries
    from django.test.utils import CaptureQueriesContext

    ids = _prepare(variant, n, f"trace-{executor}")
    reset_queries()  # a full query log (DEBUG) would leave the capture empty
    with CaptureQueriesContext(connection) as captured:
        _claim_all(executor, ids)
    return len(captured) / len(ids)


def run(n: int = 1500, rounds: int = 3, progress: Callable[[str], None] = print) -> dict:
    """Claims per second per executor and variant (median of ``rounds``), and the ratios."""
    runs: list[dict] = []
    for r in range(1, rounds + 1):
        for executor in ("postgres", "orm"):
            order = VARIANTS if r % 2 else VARIANTS[::-1]
            for variant in order:
                ids = _prepare(variant, n if executor == "postgres" else n // 2, f"{r}-{executor}")
                seconds, swapped, won = _claim_all(executor, ids)
                rate = len(ids) / seconds
                runs.append(
                    {
                        "round": r,
                        "executor": executor,
                        "variant": variant,
                        "claims": len(ids),
                        "won": won,
                        "swapped": swapped,
                        "rate": rate,
                    }
                )
                progress(
                    f"scheduling: round {r} {executor:8} {variant:20} {rate:7.1f} claims/s "
                    f"({swapped} of {len(ids)} took another job of the queue)"
                )
    queries = {
        f"{executor}/{variant}": _queries_per_claim(executor, variant)
        for executor in ("postgres", "orm")
        for variant in VARIANTS
    }
    Attempt.objects.filter(job__kind=KIND).delete()
    Job.objects.filter(kind=KIND).delete()
    medians = {}
    for executor in ("postgres", "orm"):
        for variant in VARIANTS:
            key = (executor, variant)
            rates = [x["rate"] for x in runs if (x["executor"], x["variant"]) == key]
            medians[f"{executor}/{variant}"] = statistics.median(rates)
    ratios = {
        executor: medians[f"{executor}/{VARIANTS[1]}"] / medians[f"{executor}/{VARIANTS[0]}"]
        for executor in ("postgres", "orm")
    }
    return {
        "runs": runs,
        "median_claims_s": medians,
        "queries_per_claim": queries,
        "ratio_with_to_without": ratios,
    }


def report_lines(res: dict) -> tuple[list[str], list[str]]:
    """The section's lines and its summary line."""
    if not res:
        return [], []
    lines = ["", "claim throughput with priorities and queues in use (in process, one claimer)"]
    queries = res.get("queries_per_claim", {})
    for key, rate in res["median_claims_s"].items():
        per = f", {queries[key]:.2f} round trips per claim" if key in queries else ""
        lines.append(f"  {key:32} {rate:8.1f} claims/s (median){per}")
    ratios = res["ratio_with_to_without"]
    summary = "claim with priorities+queues / plain: " + ", ".join(
        f"{executor} {ratio:.3f}" for executor, ratio in ratios.items()
    )
    return lines, [summary]
