"""Two settings the hot path pays for, measured (figures only; nothing is asserted).

- fsync in the artifact write: the same write as the engine's and the plain
  tasks' (temporary file, rename) of the minimal kind's body and of a report
  PDF, with no fsync, with the file fsynced (what ``jobs.artifacts`` does
  today), and with the file and its folder fsynced, on the artifact root's
  filesystem;
- ``CONN_HEALTH_CHECKS`` for the workers: ``demo.summary`` drained with the
  production setting (on) and with it off (``BENCH_CONN_HEALTH_CHECKS=0``;
  django-q2 already calls ``close_old_connections()`` around every task).
"""

from __future__ import annotations

import shutil
import statistics
import time
import uuid
from pathlib import Path

from bench import e2e, plain
from jobs.models import Job
from permits import reports
from permits.management.commands.seed_demo import EPOCH
from permits.models import PermitRequest

FSYNC_VARIANTS = {
    "no fsync": (False, False),
    "fsync file (today)": (True, False),
    "fsync file + folder": (True, True),
}
HEALTH = {"on (production)": "1", "off": "0"}


def filesystem(path: Path) -> str:
    """The filesystem type and mount point ``path`` lives on (from /proc/self/mounts)."""
    path = path.resolve()
    best = ("?", "/")
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return "unknown"
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1]
        if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(
            mount
        ) >= len(best[1]):
            best = (fields[2], mount)
    return f"{best[0]} on {best[1]}"


def fsync_cost(n: int) -> dict:
    """Median µs of one artifact write for each payload and fsync variant.

    The variants take turns write by write, so a busy moment on the disk falls on
    all of them alike.
    """
    permit = PermitRequest.objects.select_related("tenant").order_by("pk").first()
    pdf = reports.render_report(permit, Job(pk=84, output_revision=29, created_at=EPOCH))
    small = (
        "Summary for bench.item 0123abcd-1234, revision 1\n"
        f"Generated for job 12345 at {EPOCH.isoformat()}\n"
    ).encode()
    payloads = {f"small ({len(small)} B)": small, f"report ({len(pdf) / 1024:.1f} KiB)": pdf}
    folder = f"knobs-{uuid.uuid4().hex[:8]}"
    samples: dict[tuple[str, str], list[float]] = {}
    try:
        for i in range(n):
            for label, data in payloads.items():
                for variant, (f_file, f_dir) in FSYNC_VARIANTS.items():
                    name = f"{folder}/{i}-{len(data)}-{f_file:d}{f_dir:d}.bin"
                    t = time.perf_counter()
                    plain.write_file(name, data, fsync_file=f_file, fsync_dir=f_dir)
                    samples.setdefault((label, variant), []).append((time.perf_counter() - t) * 1e6)
    finally:
        shutil.rmtree(plain.artifact_root() / folder, ignore_errors=True)
    return {
        "filesystem": filesystem(plain.artifact_root()),
        "writes": n,
        "median_us": {
            label: {v: statistics.median(samples[(label, v)]) for v in FSYNC_VARIANTS}
            for label in payloads
        },
    }


def health_checks(n: int, workers: int, user_id: int, rounds: int, progress=print) -> dict:
    """``demo.summary`` drained with CONN_HEALTH_CHECKS on and off, alternating per round."""
    runs = []
    order = list(HEALTH.items())
    for r in range(1, rounds + 1):
        for label, value in order[(r - 1) % 2 :] + order[: (r - 1) % 2]:
            run = e2e.run(
                e2e.SUMMARY, n, workers, user_id, round=r, env={"BENCH_CONN_HEALTH_CHECKS": value}
            )
            cpu = sum(run.drain.cpu_ms.values())
            xacts = run.drain.server.get("xact_commit", float("nan"))
            progress(
                f"knobs: CONN_HEALTH_CHECKS {label:16} round {r}: {run.rate:7.1f} jobs/s, "
                f"CPU {cpu:.1f} ms/job, {xacts:.1f} xacts/job"
                f"{'' if run.ok else ', CHECK FAILED ' + str(run.check)}"
            )
            runs.append(
                {
                    "setting": label,
                    "round": r,
                    "n": n,
                    "rate": run.rate,
                    "cpu_ms_per_job": run.drain.cpu_ms,
                    "server_per_job": run.drain.server,
                    "ok": run.ok,
                }
            )
    return {"workers": workers, "runs": runs}
