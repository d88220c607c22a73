"""Real processes for end-to-end tests (the harness is ``jobs.testing.processes``).

Every process leads its own process group, so a whole qcluster (sentinel, pusher,
monitor, workers) can be killed at once, and the ``procs`` fixture (conftest.py)
kills them all before the database is flushed. ``manage.py jobs_worker`` starts
its qcluster in a process group of its own: stopping one of our processes stops
the groups of everything it started too.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django_q.models import OrmQ

from jobs.models import Attempt, Job
from jobs.testing.processes import Processes
from jobs.testing.scratchdb import url_from_settings
from tests.jobs.helpers import request_job

ROOT = Path(__file__).resolve().parents[2]
PROVIDER_TOKEN = "e2e-token-0123"  # the stand-in provider's (conftest.provider)


def site_processes(env: dict[str, str], log_dir: Path) -> Processes:
    """Processes that run this checkout's ``manage.py`` (the site and the test apps)."""
    return Processes(env, log_dir, command=(sys.executable, "manage.py"), cwd=ROOT)


def local_ports(pid: int) -> set[int]:
    """Local TCP ports of the IPv4 sockets process ``pid`` holds (its database connections)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[9] in inodes:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def database_address() -> tuple[str, int]:
    """Host and port of the test database's server."""
    db = settings.DATABASES["default"]
    return db.get("HOST") or "127.0.0.1", int(db.get("PORT") or 5432)


def subprocess_env(*, port: int | None = None) -> dict[str, str]:
    """The subprocesses use the test database and artifact root of this test process.

    ``port``: reach the server through another port (a ``DatabaseProxy`` in front).
    """
    db = settings.DATABASES["default"]
    assert db["ENGINE"] == "django.db.backends.postgresql", db["ENGINE"]
    if port:
        db = {**db, "HOST": "127.0.0.1", "PORT": port}
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=url_from_settings(db),
        ARTIFACT_ROOT=str(settings.STORAGES["artifacts"]["OPTIONS"]["location"]),
        PYTHONUNBUFFERED="1",
        Q_LOG_LEVEL="INFO",
    )
    env.pop("TEST_DATABASE_NAME", None)  # the subprocess uses NAME as it is
    return env


def request_steps_job(user, revision: int, *, tenant_key: str, **params) -> Job:
    """A new ``test.steps`` job for ``user`` (its notice goes to them); params shape the work."""
    job, created = request_job(
        "test.steps",
        subject_type="auth.user",
        subject_id=user.pk,
        output_revision=revision,
        tenant_key=tenant_key,
        params={"recipients": [user.pk], **params},
    )
    assert created, f"job {job.pk} existed already"
    return job


def jobs_stats(env: dict[str, str]) -> dict:
    """``manage.py jobs_stats --json`` run as its own process with ``env``."""
    done = subprocess.run(
        [sys.executable, "manage.py", "jobs_stats", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"jobs_stats failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


def wait_until(
    procs: Processes,
    what: str,
    check: Callable[[], Any],
    *,
    timeout: float,
    interval: float = 0.05,
) -> Any:
    """Poll ``check`` until it returns something truthy; fail with the logs at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        procs.check_alive()
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what}; last check gave "
                f"{result!r}\n{job_table()}\n{procs.logs()}"
            )
        time.sleep(interval)


def job_table() -> str:
    rows = [
        f"job {j.pk} state={j.state} v={j.version} attempts={j.attempts} "
        f"owner={j.lease_owner} lease={j.lease_expires_at}"
        for j in Job.objects.all()
    ]
    rows += [
        f"  attempt {a.pk} job={a.job_id} n={a.number} worker={a.worker} outcome={a.outcome!r}"
        for a in Attempt.objects.order_by("id")
    ]
    rows += [f"  ormq {m.pk} name={m.name()} lock={m.lock}" for m in OrmQ.objects.all()]
    return "\n".join(rows)
