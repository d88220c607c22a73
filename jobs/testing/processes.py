"""Real processes for tests, drills and benchmarks: start, stop by process group, read logs.

Every process leads its own process group (``start_new_session``), so a whole
qcluster (sentinel, pusher, monitor, workers) is stopped with one ``killpg``.
``manage.py jobs_worker`` runs its qcluster in a group of its own: stopping one
of our processes stops the groups of all its descendants too (``proctree``), so
nothing a test started outlives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from jobs.supervisor import group_members
from jobs.testing.proctree import groups_of


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    role: str = ""
    killed: bool = False  # stopped on purpose: its exit is not a failure

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None


def proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name: state, ppid, pgrp, ..."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()  # comm may hold spaces: split after ')'


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in the group."""
    return bool(group_members(pgid))


def _kill_groups(groups: set[int], timeout: float = 10) -> None:
    """SIGKILL every group, then wait until none has a live member."""
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(group_alive(g) for g in groups):
        time.sleep(0.05)


@dataclass
class Processes:
    """The subprocesses of one run; each leads its own process group.

    ``command`` is what the arguments of ``start`` are appended to: by default
    ``python -m django`` (``DJANGO_SETTINGS_MODULE`` comes from ``env``).
    """

    env: dict[str, str]
    log_dir: Path
    command: Sequence[str] = (sys.executable, "-m", "django")
    cwd: Path | str | None = None
    procs: list[Proc] = field(default_factory=list)

    def start(
        self,
        name: str,
        *args: str,
        role: str = "",
        stdout: int | IO | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """Start ``command *args``; output goes to ``log_dir/NAME.log`` (stdout may be a pipe)."""
        log_path = Path(self.log_dir) / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - the child owns it; closed after Popen
        try:
            popen = subprocess.Popen(
                [*self.command, *args],
                cwd=self.cwd,
                env=self.env if env is None else env,
                stdin=subprocess.DEVNULL,
                stdout=stdout if stdout is not None else log,
                stderr=log if stdout is not None else subprocess.STDOUT,
                start_new_session=True,  # pgid == pid: the whole tree can be killed
            )
        finally:
            log.close()
        proc = Proc(name, popen, log_path, role)
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
        """SIGKILL a process and everything it started (its groups too); wait until gone."""
        proc.killed = True
        groups = groups_of(proc.pid)
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=10)
        _kill_groups(groups)

    def terminate(self, proc: Proc, timeout: float = 10) -> None:
        """SIGTERM (a clean stop), then SIGKILL the group if it is still there."""
        proc.killed = True
        groups = groups_of(proc.pid)
        if proc.alive():
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout)
        with contextlib.suppress(subprocess.TimeoutExpired):
            _kill_groups(groups)
            proc.popen.wait(timeout=5)

    def dead(self) -> list[str]:
        """Names of processes that exited on their own with a failure."""
        return [p.name for p in self.procs if not p.killed and p.popen.poll() not in (None, 0)]

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

    def stop_all(self, procs: Sequence[Proc] | None = None) -> None:
        """SIGKILL every group (or the given ones) and wait until they are gone."""
        chosen = list(self.procs if procs is None else procs)
        # Every group first (a jobs_worker's qcluster has its own), then the kills.
        groups = {g for proc in chosen for g in groups_of(proc.pid)}
        for proc in chosen:
            proc.killed = True
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        for proc in chosen:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
        _kill_groups(groups)
