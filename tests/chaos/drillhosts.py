"""Worker "hosts" of a drill on one machine: each its own ``manage.py jobs_worker`` with
its own host name and temporary folder, started together and waited for until each
cluster says it runs (the fairness and horizon drills)."""

from __future__ import annotations

import time
from pathlib import Path

from jobs.testing.processes import Processes


def start_hosts(
    procs: Processes, env: dict, work: Path, n: int, *, tag: str, extra: dict | None = None
) -> list:
    """Start ``n`` hosts (``host-a``, ``host-b``, ...); RuntimeError if a cluster did not
    start within 90 s."""
    from tests.chaos.scaleout import CLUSTER_RUNNING

    started = []
    for i in range(n):
        name = f"host-{'abcdefgh'[i]}"
        folder = work / f"{name}-{tag}"
        (folder / "tmp").mkdir(parents=True)
        host_env = {**env, "JOBS_HOST_NAME": name, "TMPDIR": str(folder / "tmp"), **(extra or {})}
        started.append(
            procs.start(
                f"{name}.{tag}",
                "jobs_worker",
                "--stop-timeout=5",
                "--stall-seconds=25",
                env=host_env,
            )
        )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        logs = [p.log_path.read_text(errors="replace") for p in started]
        if all(CLUSTER_RUNNING.search(text) for text in logs):
            return started
        time.sleep(0.2)
    raise RuntimeError("the hosts' clusters did not start")
