"""What jobs.telemetry costs per job: OpenTelemetry absent, installed but off, and on.

    .venv/bin/python -m bench.telemetry [--block 25] [--blocks 9] [--hooks 20000]

Two figures, in one process each (absent runs in a child with ``opentelemetry`` hidden):

1. hooks alone: the sequence of hooks one report job passes (request, attempt, three
   stages, two steps, publish, one release with a lookup) around functions that do
   nothing, so the figure is the hooks' own cost; "on" records every span with the SDK
   (in-memory exporter, ``SimpleSpanProcessor``) and counts every instrument, except
   the attempt's one UPDATE of ``Job.trace_context`` (no database here; part 2 has it).
   Absent is a child with ``opentelemetry`` hidden.
2. same work: real jobs (``test.steps``: claim, artifact, publish, one in-app notice)
   on an in-memory SQLite database, artifacts on tmpfs: CPU ms per job, the three modes
   interleaved in blocks in one process (absent emulated by putting the undecorated
   functions back, which is what the decorators leave without the API), and the ratio
   to absent.

Both figures are the process's CPU time (``process_time``), so other work on the machine
moves them less than wall time; compare modes of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    os.environ.pop("DATABASE_URL", None)
    sys.path.insert(0, ROOT)
    import tempfile

    import django

    django.setup()
    from django.conf import settings
    from django.db import connection

    # Artifacts on tmpfs where there is one: the disk's fsync would drown the figure.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    settings.STORAGES["artifacts"]["OPTIONS"]["location"] = tempfile.mkdtemp(dir=shm)

    connection.creation.create_test_db(verbosity=0)
    import logging

    logging.disable(logging.CRITICAL)  # the engine's INFO lines would dominate the figure


def _hook_set(telemetry):
    """Nothing-doing functions behind the engine's decorators, as each mode leaves them."""
    job = SimpleNamespace(
        pk=1, kind="permits.report", uid="u", output_revision=1, tenant_key="t", attempts=1
    )
    job.trace_context = ""
    effect = SimpleNamespace(
        pk=1,
        job=job,
        job_id=1,
        provider="webhook",
        name="completion-notice",
        idempotency_key="fx-" + "0" * 40,
        attempts=1,
        last_error_class="",
        state="applied",
    )
    claim = SimpleNamespace(job=job, attempt=SimpleNamespace(pk=1, started_at=None))
    ctx = SimpleNamespace(job=job)

    request = telemetry.traced_request(lambda kind, subject: SimpleNamespace(job=job, created=True))
    step = telemetry.traced_step(lambda ctx, name, fn, lookup=None: fn())
    publish = telemetry.traced_publish(lambda ctx, output: [effect])
    look_up = telemetry.traced_lookup(lambda provider, effect, worker: "ref-1")
    release = telemetry.traced_release(
        lambda effect, worker, prior: (look_up(None, effect, worker), "applied")[1]
    )

    def handler(claim, worker):
        for name in ("claimed", "artifact_stored", "before_publish"):
            telemetry.stage(name)
        step(ctx, "gather", dict)
        step(ctx, "render", dict)
        publish(ctx, None)
        return SimpleNamespace(outcome="succeeded")

    attempt = telemetry.traced_attempt(handler)

    def one_job() -> None:
        request("permits.report", ("permits.permitrequest", 1))
        attempt(claim, "w1")
        release(effect, "w1", "pending")

    return one_job


def hooks(mode: str, n: int) -> float:
    """ns per job of the hooks alone."""
    from jobs import telemetry

    if mode == "on":
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from jobs.telemetry import otel

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        telemetry.configure(
            tracer_provider=provider,
            meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]),
        )
        otel._remember_attempt = lambda job, request, span: None  # no database here
    else:
        telemetry.configure()
    one_job = _hook_set(telemetry)
    for _ in range(min(n, 500)):
        one_job()
    best = float("inf")
    for _ in range(5):  # the best of five: the machine's other work only adds
        began = time.process_time_ns()
        for i in range(n):
            one_job()
            if mode == "on" and i % 1000 == 999:
                exporter.clear()
        best = min(best, (time.process_time_ns() - began) / n)
    return best


# The engine's decorated boundaries: "unwrapped" puts the plain functions back, which is
# what an absent API leaves (the decorators return them unchanged).
BOUNDARIES = [
    ("jobs.api", "request"),
    ("jobs.delivery.runner", "run_claim"),
    ("jobs.delivery.runner", "_publish"),
    ("jobs.delivery.steps", "run"),
    ("jobs.delivery.release", "release"),
    ("jobs.delivery.release", "send_claimed"),
    ("jobs.delivery.release", "_look_up"),
]


def _switch(mode: str, wrapped: dict, sdk) -> None:
    """Put this process in ``mode``: unwrapped (as absent), off, or on (the SDK)."""
    import importlib

    from jobs import telemetry

    for (module, name), fn in wrapped.items():
        plain = getattr(fn, "__wrapped__", fn) if mode == "unwrapped" else fn
        setattr(importlib.import_module(module), name, plain)
    if mode == "on":
        telemetry.configure(tracer_provider=sdk)
    else:
        telemetry.configure()


def same_work(n: int, rounds: int) -> dict[str, tuple[float, float, float]]:
    """CPU ms per real job (request, delivery, publish, in-app notice, SQLite in memory)
    in each mode, interleaved in this one process: blocks of ``n`` jobs, ``rounds`` blocks
    per mode in rotating order, the median block per mode."""
    import importlib

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from jobs import api
    from jobs.delivery.runner import run_delivery

    exporter = InMemorySpanExporter()
    sdk = TracerProvider()
    sdk.add_span_processor(SimpleSpanProcessor(exporter))
    wrapped = {(m, f): getattr(importlib.import_module(m), f) for m, f in BOUNDARIES}
    counter = iter(range(10**9))

    def run() -> None:
        handle = api.request("test.steps", ("auth.user", next(counter)), params={"recipients": [1]})
        assert run_delivery(handle.id, worker="bench").outcome == "succeeded"

    modes = ["unwrapped", "off", "on"]
    blocks: dict[str, list[float]] = {m: [] for m in modes}
    for mode in modes:  # warm-up: imports, caches, statements
        _switch(mode, wrapped, sdk)
        for _ in range(20):
            run()
    for r in range(rounds):
        for mode in modes[r % 3 :] + modes[: r % 3]:
            _switch(mode, wrapped, sdk)
            began = time.process_time()  # this process's CPU: other load stays out
            for _ in range(n):
                run()
            blocks[mode].append((time.process_time() - began) * 1000 / n)
            exporter.clear()
    _switch("off", wrapped, sdk)
    return {m: (statistics.median(b), min(b), max(b)) for m, b in blocks.items()}


def child(args) -> None:
    if args.mode == "absent":
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]
    _setup()
    from django.contrib.auth.models import User

    User.objects.create(pk=1, username="bench-reviewer")
    from jobs import telemetry

    assert (args.mode != "absent") == telemetry.AVAILABLE
    out: dict = {"mode": args.mode}
    if args.mode == "absent":
        out["hooks_ns"] = {"absent": hooks("absent", args.hooks)}
    else:
        out["hooks_ns"] = {"off": hooks("off", args.hooks)}
        out["job_ms"] = same_work(args.block, args.blocks)  # before "on" patches otel
        out["hooks_ns"]["on"] = hooks("on", args.hooks)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=25, help="jobs per block")
    parser.add_argument("--blocks", type=int, default=9, help="blocks per mode")
    parser.add_argument("--hooks", type=int, default=20_000)
    parser.add_argument("--mode", choices=["absent", "installed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        return child(args)
    got = {}
    for mode in ("absent", "installed"):
        sizes = [
            "--block",
            str(args.block),
            "--blocks",
            str(args.blocks),
            "--hooks",
            str(args.hooks),
        ]
        out = subprocess.run(
            [sys.executable, "-m", "bench.telemetry", "--mode", mode, *sizes],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        got[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    hooks_ns = {**got["absent"]["hooks_ns"], **got["installed"]["hooks_ns"]}
    job = got["installed"]["job_ms"]
    print(f"hooks alone, CPU per job (best of 5 x {args.hooks}):")
    for mode in ("absent", "off", "on"):
        print(f"  {mode:<10}{hooks_ns[mode] / 1000:>10.2f} us")
    print(
        f"same work, CPU ms per job (median of {args.blocks} blocks of {args.block}, "
        "interleaved in one process):"
    )
    base = job["unwrapped"]
    for mode, label in (("unwrapped", "absent"), ("off", "off"), ("on", "on")):
        median, low, high = job[mode]
        print(
            f"  {label:<10}{median:>8.2f} ms  x{median / base[0]:.3f}   "
            f"(blocks {low:.2f}-{high:.2f}; best x{low / base[1]:.3f})"
        )
    print(
        f"off vs absent: {hooks_ns['off'] - hooks_ns['absent']:+.0f} ns/job of hooks; "
        f"on: {hooks_ns['on'] / 1000:.0f} us/job of hooks"
    )


if __name__ == "__main__":
    main()
