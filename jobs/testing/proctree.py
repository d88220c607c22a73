"""The process tree from /proc (Linux): children, the process groups under a process, and
how a helper server is stopped.

``manage.py jobs_worker`` runs its qcluster in a process group of its own, so
killing "everything a test started" means the groups of every descendant too.
No Django imports: the soak uses this before Django is set up.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgid) of every live (non-zombie) process."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after ')'
            fields = stat.read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[0] != "Z":
            table[int(stat.parent.name)] = (int(fields[1]), int(fields[2]))
    return table


def children(pid: int, table: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """Live direct children of ``pid``."""
    table = process_table() if table is None else table
    return sorted(p for p, (ppid, _) in table.items() if ppid == pid)


def groups_of(pid: int) -> set[int]:
    """The process group ``pid`` leads and the groups of all its live descendants."""
    table = process_table()
    groups, todo = {pid}, [pid]
    while todo:
        parent = todo.pop()
        for p, (ppid, pgid) in table.items():
            if ppid == parent:
                groups.add(pgid)
                todo.append(p)
    return groups


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL once ``timeout`` has passed: a helper server never outlives
    its test, however it answers the polite signal."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
