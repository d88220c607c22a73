"""``python -m bench.compare REF [REF ...]``: earlier commits' same-work ratios beside this tree's.

An issue's "the ratio does not fall" needs a before and an after measured in one run on
one machine: figures of two ``make bench`` runs an hour apart differ by more than most
changes do. Each round runs every tree once, in turn (the order rotates per round): a
worktree of each ``REF`` under ``var/bench/trees/`` and this tree. Each tree runs its
own code, migrations and ``bench`` package (its ``bench.e2e.run``: empty tables, ``N``
queued jobs, a real ``qcluster`` drain, the same settings as its ``make bench``) under
this tree's virtualenv, against a ``bench_e2e`` database it creates afresh; it drains
60 jobs of each kind unmeasured first, then each pair, plain task first in even rounds and
engine kind first in odd ones (so use an even number of rounds). A tree's
ratio is engine kind / plain task doing the same work on django-q2's ORM broker, as
``make bench`` measures it; the summary gives each ratio's median over the rounds and
after / before.

``make bench BENCH_ARGS="--before REF"`` runs the same after its other sections.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ROOT / "var" / "bench" / "trees"
# (plain task, engine kind): the pairs of make bench's same-work ratios.
PAIRS = (("plain_minimal", "summary"), ("plain_report", "report"))
HERE = "this tree"
# What this process's own bench run put in its environment (bench.infra.start_django,
# bench.settings): each tree sets its own (under make bench, the artifact root was this
# tree's, so the other trees' plain tasks wrote where their checks did not count).
_OURS = ("PYTHONPATH", "ARTIFACT_ROOT", "DJANGO_SETTINGS_MODULE", "BENCH_DB", "SECRET_KEY", "DEBUG")
WARM_UP = 60  # jobs of each kind drained, unmeasured, before a tree's measured runs

# Runs inside a tree (its own bench package: this module may not exist there). It uses
# only what every tree's bench has had since before issue 41: infra.start_django,
# workloads.prepare_database and e2e.run(kind, n, workers, user_id, round=...).
_CHILD = """
import json, sys
from bench import infra
infra.start_django()
import jobs
from bench import e2e, workloads
plan = json.loads(sys.argv[1])
user_id = workloads.prepare_database()
out = {"jobs_module": jobs.__file__, "runs": {}}
for kind, n in plan["kinds"]:
    e2e.run(kind, plan["warm_up"], plan["workers"], user_id, round=plan["round"])
for kind, n in plan["kinds"]:
    run = e2e.run(kind, n, plan["workers"], user_id, round=plan["round"])
    out["runs"][kind] = {"rate": run.rate, "ok": bool(run.ok)}
print("COMPARE " + json.dumps(out), flush=True)
"""


@dataclass
class Tree:
    """One side of the comparison: a commit checked out apart, or this tree."""

    label: str
    path: Path
    commit: str
    rates: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def ratios(self, plain: str, engine: str) -> list[float]:
        plains, engines = self.rates.get(plain, []), self.rates.get(engine, [])
        return [e / p for p, e in zip(plains, engines, strict=False)]


def say(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ("git", *args), cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def checkout(ref: str) -> Tree:
    """A detached worktree of ``ref`` (kept between runs: the checkout is the slow part)."""
    commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    path = TREES / commit[:12]
    if not (path / "manage.py").exists():
        TREES.mkdir(parents=True, exist_ok=True)
        _git("worktree", "prune")
        _git("worktree", "add", "--detach", "--force", str(path), commit)
    return Tree(label=ref, path=path, commit=commit)


def _run_tree(tree: Tree, kinds: list[tuple[str, int]], workers: int, rnd: int) -> None:
    """One turn of a tree: a short unmeasured run of every kind first (a fresh database,
    a fresh tree's bytecode and the page cache would otherwise cost the first kind), then
    the pairs, plain task first in even rounds and engine first in odd ones."""
    if rnd % 2:
        kinds = [k for pair in zip(kinds[1::2], kinds[::2], strict=True) for k in pair]
    plan = json.dumps({"kinds": kinds, "workers": workers, "round": rnd, "warm_up": WARM_UP})
    env = {k: v for k, v in os.environ.items() if k not in _OURS}
    proc = subprocess.run(
        (sys.executable, "-c", _CHILD, plan),
        cwd=tree.path,
        env=env,
        capture_output=True,
        text=True,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("COMPARE ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        tree.failures.append(f"round {rnd + 1}: exit {proc.returncode}: " + " | ".join(tail))
        say(f"{tree.label}: round {rnd + 1} failed (exit {proc.returncode})")
        return
    out = json.loads(line[len("COMPARE ") :])
    expected = tree.path / "jobs" / "__init__.py"
    if Path(out["jobs_module"]).resolve() != expected.resolve():
        raise SystemExit(f"{tree.label} imported jobs from {out['jobs_module']}, not {expected}")
    for kind, run in out["runs"].items():
        if not run["ok"]:
            tree.failures.append(f"round {rnd + 1}: {kind} failed its exactly-once check")
        tree.rates.setdefault(kind, []).append(run["rate"])
    say(
        f"{tree.label}: round {rnd + 1}: "
        + ", ".join(f"{k} {r['rate']:.1f}/s" for k, r in out["runs"].items())
    )


def run(
    refs: list[str],
    *,
    n_minimal: int,
    n_report: int,
    rounds: int,
    workers: int,
    pairs: tuple[str, ...] = ("minimal", "report"),
) -> dict:
    """Every tree once a round, rotating the order; the figures and the summary lines."""
    trees = [checkout(ref) for ref in refs]
    trees.append(Tree(label=HERE, path=ROOT, commit=_git("rev-parse", "HEAD")))
    kinds: list[tuple[str, int]] = []
    if "minimal" in pairs:
        kinds += [("plain_minimal", n_minimal), ("summary", n_minimal)]
    if "report" in pairs:
        kinds += [("plain_report", n_report), ("report", n_report)]
    for rnd in range(rounds):
        order = trees[rnd % len(trees) :] + trees[: rnd % len(trees)]
        for tree in order:
            _run_tree(tree, kinds, workers, rnd)
    return summarize(trees, n_minimal=n_minimal, n_report=n_report, rounds=rounds)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(trees: list[Tree], **args: int) -> dict:
    """Medians per tree and after / before against this tree; printed and returned."""
    here = trees[-1]
    result: dict = {"args": args, "trees": {}, "lines": []}
    for tree in trees:
        entry = {"commit": tree.commit, "failures": tree.failures, "rates": tree.rates}
        for plain, engine in PAIRS:
            entry[f"{engine}/{plain}"] = {
                "per_round": tree.ratios(plain, engine),
                "median": _median(tree.ratios(plain, engine)),
            }
        result["trees"][tree.label] = entry
    for tree in trees[:-1]:
        for plain, engine in PAIRS:
            before = _median(tree.ratios(plain, engine))
            after = _median(here.ratios(plain, engine))
            if before is None or after is None:
                line = f"compare: {engine}/{plain} {tree.label}: no figures (see failures)"
            else:
                line = (
                    f"compare: {engine}/{plain} ratio {tree.label} ({tree.commit[:7]}) "
                    f"{before:.3f} -> {HERE} ({here.commit[:7]}) {after:.3f}: "
                    f"after/before {after / before:.3f}"
                )
            result["lines"].append(line)
    for tree in trees:
        for plain, engine in PAIRS:
            per_round = " ".join(f"{x:.3f}" for x in tree.ratios(plain, engine))
            engine_rates = " ".join(f"{x:.1f}" for x in tree.rates.get(engine, []))
            result["lines"].append(
                f"compare: {tree.label} {engine}/{plain} per round {per_round or '-'}"
                f" ({engine} jobs/s {engine_rates or '-'})"
            )
        for failure in tree.failures:
            result["lines"].append(f"compare: {tree.label} FAILED {failure}")
    return result


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    p.add_argument("refs", nargs="+", help="commits to measure beside this tree")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--n-minimal", type=int, default=1500, help="jobs per minimal run")
    p.add_argument("--n-report", type=int, default=360, help="jobs per report run")
    p.add_argument("--pairs", default="minimal,report", help="minimal, report or both")
    p.add_argument("--json", default="var/bench/compare.json")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _args(argv)
    result = run(
        args.refs,
        n_minimal=args.n_minimal,
        n_report=args.n_report,
        rounds=args.rounds,
        workers=args.workers,
        pairs=tuple(args.pairs.split(",")),
    )
    path = ROOT / args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    for line in result["lines"]:
        print(line)
    return 1 if any(t["failures"] for t in result["trees"].values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
