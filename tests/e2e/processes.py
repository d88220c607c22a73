"""Real processes for end-to-end tests: start, kill by process group, read their logs.

Every process leads its own process group (``start_new_session``), so a whole
qcluster (sentinel, pusher, monitor, workers) can be killed at once, and the
``procs`` fixture (conftest.py) kills them all before the database is flushed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django_q.models import OrmQ

from jobs.models import Attempt, Job

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    killed: bool = False  # killed on purpose: its exit is not a failure

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class Processes:
    """The subprocesses of one test; each leads its own process group."""

    env: dict[str, str]
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, *args: str) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - the child owns it; closed after Popen
        try:
            popen = subprocess.Popen(
                [sys.executable, "manage.py", *args],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # pgid == pid: the whole cluster can be killed
            )
        finally:
            log.close()
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def owner_of(self, pid: int) -> Proc | None:
        """Which of our processes' groups ``pid`` belongs to (None if not ours)."""
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            return None
        return next((p for p in self.procs if p.pid == pgid), None)

    def kill_group(self, proc: Proc) -> None:
        """SIGKILL a process and every child it forked (sentinel, pusher, monitor, workers)."""
        proc.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and group_alive(proc.pid):
            time.sleep(0.05)

    def check_alive(self) -> None:
        for proc in self.procs:
            if not proc.killed and proc.popen.poll() is not None:
                raise AssertionError(
                    f"{proc.name} (pid {proc.pid}) exited unexpectedly with code "
                    f"{proc.popen.returncode}\n{self.logs()}"
                )

    def logs(self, tail: int = 80) -> str:
        parts = []
        for proc in self.procs:
            try:
                lines = proc.log_path.read_text(errors="replace").splitlines()
            except OSError as exc:
                lines = [f"<log unreadable: {exc}>"]
            parts.append(
                f"----- {proc.name} (pid {proc.pid}) last {tail} lines -----\n"
                + "\n".join(lines[-tail:])
            )
        return "\n".join(parts)

    def stop_all(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(group_alive(p.pid) for p in self.procs):
            time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in the group."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after ')'
        fields = text.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def subprocess_env() -> dict[str, str]:
    """The subprocesses use the test database and artifact root of this test process."""
    db = settings.DATABASES["default"]
    assert db["ENGINE"] == "django.db.backends.postgresql", db["ENGINE"]
    user = db.get("USER") or "root"
    if db.get("PASSWORD"):
        user = f"{user}:{db['PASSWORD']}"
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=f"postgres://{user}@{host}:{port}/{db['NAME']}",
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
