"""Real processes for end-to-end tests: start, kill by process group, read their logs.

Every process leads its own process group (``start_new_session``), so a whole
qcluster (sentinel, pusher, monitor, workers) can be killed at once, and the
``procs`` fixture (conftest.py) kills them all before the database is flushed.
``manage.py jobs_worker`` starts its qcluster in a process group of its own: killing
one of our processes kills the groups of everything it started too.
"""

from __future__ import annotations

import contextlib
import json
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
from jobs.services import request_job
from jobs.supervisor import group_members
from tests.chaos.proctree import groups_of

ROOT = Path(__file__).resolve().parents[2]
PROVIDER_TOKEN = "e2e-token-0123"  # the stand-in provider's (conftest.provider)


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

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - the child owns it; closed after Popen
        try:
            popen = subprocess.Popen(
                [sys.executable, "manage.py", *args],
                cwd=ROOT,
                env=self.env if env is None else env,
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
        groups = groups_of(proc.pid)
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        proc.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(group_alive(g) for g in groups):
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
        # Every group first (a jobs_worker's qcluster has its own), then the kills.
        groups = {g for proc in self.procs for g in groups_of(proc.pid)}
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(group_alive(g) for g in groups):
            time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in the group."""
    return bool(group_members(pgid))


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
    user = db.get("USER") or "root"
    if db.get("PASSWORD"):
        user = f"{user}:{db['PASSWORD']}"
    host, port = ("127.0.0.1", port) if port else database_address()
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
