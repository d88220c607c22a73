"""Real processes for end-to-end tests (the harness is ``jobs.testing.processes``).

Every process leads its own process group, so a whole qcluster (sentinel,
pusher, monitor, workers) can be killed at once, and the ``procs`` fixture
(conftest.py) kills them all before the database is flushed.
"""

from __future__ import annotations

import os
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

ROOT = Path(__file__).resolve().parents[2]


def site_processes(env: dict[str, str], log_dir: Path) -> Processes:
    """Processes that run this checkout's ``manage.py`` (the site and the test apps)."""
    return Processes(env, log_dir, command=(sys.executable, "manage.py"), cwd=ROOT)


def subprocess_env() -> dict[str, str]:
    """The subprocesses use the test database and artifact root of this test process."""
    db = settings.DATABASES["default"]
    assert db["ENGINE"] == "django.db.backends.postgresql", db["ENGINE"]
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
