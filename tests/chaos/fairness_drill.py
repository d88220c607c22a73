"""The fairness drill: ``python -m tests.chaos.fairness_drill`` (issue 42, part 1).

Three "hosts" on one machine (each its own ``manage.py jobs_worker`` with its own host
name), one PostgreSQL scratch database. ``test.steps`` jobs (an artifact stored each):

1. **flood**: tenant ``a`` asks for 1,000 jobs; after 20 claims, ``b`` and ``c`` ask for
   one each. Each must be claimed within K = 2 x hosts x workers claims of its request
   (claims counted by attempt id, the order the claims were written).
2. **weights**: ``tenant:a --weight 3``; ``a`` and ``b`` both flood; of the first 400
   claims the shares must be within 10% of 3:1.
3. **alone**: ``a`` alone, 300 jobs, three times: its best throughput (each run printed),
   with the fair order and (``--compare``,
   the hosts restarted with ``JOBS_FAIR_SHARE`` off) without; with ``--compare`` the flood
   is run without it too (positions printed: the cap-only claim's, for comparison).

The last line is ``fairness: PASS ...`` or ``fairness: FAIL ...``; exit 1 on FAIL, 2 when
the drill could not run.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from collections import Counter
from pathlib import Path

from jobs.testing import scratchdb
from jobs.testing.processes import Processes
from tests.chaos.drillhosts import scratch_project, start_hosts, tear_down

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_MODULE = "tests.chaos.fairness_settings"
KIND = "test.steps"
PARAMS = {"stages": 0}


def _say(line: str) -> None:
    print(line, flush=True)


def _ask(tenant: str, count: int, tag: str, *more: tuple[str, int]) -> None:
    """Requests of ``count`` jobs of ``tenant`` (and of each ``more`` tenant) in one
    transaction: they wait from the same commit on."""
    import jobs

    jobs.request_many(
        [
            {
                "kind": KIND,
                "subject": ("fair", f"{tag}-{who}-{i}"),
                "tenant": who,
                "params": PARAMS,
            }
            for who, many in ((tenant, count), *more)
            for i in range(many)
        ]
    )


def _last_attempt() -> int:
    from django.db.models import Max

    from jobs.models import Attempt

    return Attempt.objects.filter(number__gt=0).aggregate(m=Max("id"))["m"] or 0


def _claims_after(since: int):
    """Attempts of claims (not deferrals) after attempt id ``since``, in claim order."""
    from jobs.models import Attempt

    rows = Attempt.objects.filter(id__gt=since).exclude(
        outcome__in=[Attempt.Outcome.DEFERRED, Attempt.Outcome.DUPLICATE_DELIVERY]
    )
    return rows.order_by("id").values_list("id", "job__tenant_key", "job__subject_id")


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def _drain() -> None:
    """End the waiting work of a phase (the scratch database's own rows)."""
    from django.db.models import F

    from jobs.models import Job

    waiting = Job.objects.filter(state__in=[Job.State.QUEUED, Job.State.RETRY_WAIT])
    waiting.update(state=Job.State.CANCELLED, version=F("version") + 1)
    _wait(lambda: not Job.objects.filter(state=Job.State.RUNNING).exists(), 30)


def flood(tag: str, k: int) -> dict[str, int | None]:
    """Phase 1: the positions of ``b``'s and ``c``'s jobs after ``a``'s flood."""
    _ask("a", 1000, tag)
    start = _last_attempt()
    _wait(lambda: len(_claims_after(start)) >= 20, 60)
    asked = {}
    for tenant in ("b", "c"):
        _ask(tenant, 1, tag)
        asked[tenant] = _last_attempt()
    from jobs.models import Attempt

    seen: dict[str, int | None] = {}
    for tenant in ("b", "c"):
        mine = Attempt.objects.filter(job__tenant_key=tenant, job__subject_id__startswith=tag)
        _wait(mine.exists, 4 * k + 30)
        first = mine.order_by("id").values_list("id", flat=True).first()
        # Claims of other jobs written between the request and this claim (a claim whose
        # attempt id was drawn before the request committed counts as none).
        seen[tenant] = (
            None
            if first is None
            else Attempt.objects.filter(id__gt=asked[tenant], id__lt=first).count()
        )
    _drain()
    return seen


def weights(tag: str) -> Counter:
    """Phase 2: the shares of the first 400 claims, ``a`` at weight 3, both flooding."""
    from jobs import flow

    flow.set_rule("tenant:a", actor="drill", weight=3)
    # Both floods in one commit: asked one after the other, the hosts could drain a's
    # before b's committed (a loaded machine saw b take all 400 claims: b was alone).
    start = _last_attempt()
    _ask("a", 600, tag, ("b", 600))
    _wait(lambda: len(_claims_after(start)) >= 400, 240)
    shares = Counter(row[1] for row in list(_claims_after(start))[:400])
    _drain()
    flow.delete_rule("tenant:a", actor="drill")
    return shares


def alone(tag: str) -> float:
    """Phase 3: ``a`` alone: jobs per second from the request to the last one ended."""
    from jobs.models import Job

    began = time.monotonic()
    _ask("a", 300, tag)
    done = Job.objects.filter(subject_id__startswith=f"{tag}-a-", state=Job.State.SUCCEEDED)
    _wait(lambda: done.count() >= 300, 240)
    return done.count() / (time.monotonic() - began)


def alone_best(tag: str, runs: int = 3) -> tuple[float, list[float]]:
    """Phase 3, ``runs`` times: the best rate (the cluster's capacity: a busy machine only
    ever slows a run down) and every run's, printed."""
    rates = [alone(f"{tag}{i}") for i in range(runs)]
    return max(rates), rates


def _rates(rates: list[float]) -> str:
    return ", ".join(f"{r:.1f}" for r in rates)


def _hosts(procs: Processes, env: dict, work: Path, n: int, *, fair: bool) -> list:
    extra = {"FAIR_DRILL_FAIR_SHARE": "1" if fair else "0"}
    return start_hosts(procs, env, work, n, tag="fair" if fair else "off", extra=extra)


def run(args: argparse.Namespace) -> int:
    try:
        url = scratchdb.server_url(purpose="the fairness drill")
    except scratchdb.NotPostgres as exc:
        _say(f"fairness: cannot run: {exc}")
        return 2
    name = f"fairness_{secrets.token_hex(5)}"
    work = ROOT / "var" / "fairness" / name
    (work / "logs").mkdir(parents=True)
    k = 2 * args.hosts * args.workers
    procs = None
    verdict = "fairness: FAIL interrupted"
    try:
        env, procs = scratch_project(
            url,
            name,
            work,
            SETTINGS_MODULE,
            SOAK_Q_WORKERS=str(args.workers),
            JOBS_TENANT_CONCURRENCY=str(args.hosts * args.workers),
        )
        hosts = _hosts(procs, env, work, args.hosts, fair=True)
        _say(f"fairness {name}: {args.hosts} hosts x {args.workers} workers, K = {k}")
        seen = flood("f1", k)
        _say(f"  flood: claims between each request and its claim {seen} (K = {k})")
        shares = weights("f2")
        ratio = shares["a"] / max(1, shares["b"])
        _say(f"  weights 3:1: first 400 claims {dict(shares)}, ratio {ratio:.2f}")
        rate_fair, runs_fair = alone_best("f3")
        _say(f"  alone: {rate_fair:.1f} jobs/s with the fair order (runs {_rates(runs_fair)})")
        failures = []
        if not all(p is not None and p <= k for p in seen.values()):
            failures.append(f"flood positions {seen} over K = {k}")
        if not 2.7 <= ratio <= 3.3:
            failures.append(f"weights ratio {ratio:.2f} outside 3:1 +-10%")
        summary = f"K={k} positions={seen} shares={dict(shares)} alone={rate_fair:.1f}/s"
        if args.compare:
            procs.stop_all(hosts)
            _drain()
            hosts = _hosts(procs, env, work, args.hosts, fair=False)
            off = flood("o1", k)
            rate_off, runs_off = alone_best("o3")
            _say(
                f"  without the fair order: flood positions {off}, alone {rate_off:.1f} jobs/s "
                f"(runs {_rates(runs_off)})"
            )
            summary += f" off_positions={off} alone_off={rate_off:.1f}/s"
            if rate_fair < 0.95 * rate_off:
                failures.append(f"alone {rate_fair:.1f}/s under 0.95 x {rate_off:.1f}/s")
        for failure in failures:
            _say(f"  check failed: {failure}")
        verdict = f"fairness: {'FAIL' if failures else 'PASS'} {summary}"
        return 1 if failures else 0
    except Exception as exc:
        if procs is not None:
            _say(procs.logs(tail=20))
        verdict = f"fairness: FAIL the drill could not run: {type(exc).__name__}: {exc}"
        return 2
    finally:
        tear_down(procs, url, name, work, passed=verdict.startswith("fairness: PASS"), say=_say)
        _say(verdict)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="per host")
    parser.add_argument("--compare", action="store_true", help="also without the fair order")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
