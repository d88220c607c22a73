"""A drill's scratch project and its worker "hosts" on one machine (the fairness and
horizon drills): a scratch PostgreSQL database migrated with the drill's settings, this
process's Django pointed at it, and hosts each its own ``manage.py jobs_worker`` with its
own host name and temporary folder; then all of it stopped and dropped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from jobs.testing import scratchdb
from jobs.testing.processes import Processes

ROOT = Path(__file__).resolve().parents[2]


def scratch_project(url: str, name: str, work: Path, settings: str, **extra: str):
    """Create the scratch database ``name`` on ``url``'s server, migrate it under the
    settings module ``settings`` (``extra``: more environment), set this process up on it;
    returns the hosts' environment and a ``Processes`` for them."""
    scratch = scratchdb.create(url, name)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TEST_DATABASE_NAME", "DJANGO_SETTINGS_MODULE")
    }
    env.update(
        DJANGO_SETTINGS_MODULE=settings,
        DATABASE_URL=scratch,
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        Q_LOG_LEVEL="INFO",  # the hosts say when their cluster runs
        LOG_LEVEL="WARNING",
        ARTIFACT_ROOT=str(work / "artifacts"),
        **extra,
    )
    manage = str(ROOT / "manage.py")
    migrate = [sys.executable, manage, "migrate", "--noinput", "-v0"]
    subprocess.run(migrate, cwd=ROOT, env=env, check=True, timeout=300)
    os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
    os.environ.update(Q_LOG_LEVEL="WARNING")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    return env, Processes(env, work / "logs", command=(sys.executable, manage), cwd=ROOT)


def tear_down(
    procs: Processes | None, url: str, name: str, work: Path, *, passed: bool, say: Callable
) -> None:
    """Stop the hosts, drop the scratch database; keep ``work`` (logs) unless it passed."""
    if procs is not None:
        procs.stop_all()
    with suppress(Exception):
        from django.db import connections

        connections.close_all()
    with suppress(Exception):
        scratchdb.drop(url, name)
    if passed:
        shutil.rmtree(work, ignore_errors=True)
    else:
        say(f"kept {work}")


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
