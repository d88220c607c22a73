"""Worker hosts and the S3 store: what scaling out costs per job and per artifact.

1. Hosts: the same full queue of ``demo.summary`` jobs drained by 1, 2 and 3 "hosts"
   on this machine, each a ``manage.py qcluster`` with its own ``JOBS_HOST_NAME``
   and ``TMPDIR`` and ``--workers`` django-q2 workers. Throughput, CPU per job (all
   clusters' processes and their PostgreSQL backends), and server transactions and
   row writes per job. The machine is CPU-bound (2 cores), so throughput cannot grow
   with hosts here; the figure to watch is cost per job staying flat as hosts are
   added (no host-to-host coordination beyond the rows each job touches anyway).
2. S3: the artifact store's cost per artifact on moto's S3 server (HTTP on loopback)
   against the filesystem store: an exclusive create and a verified read of a
   report-sized artifact, in this process.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from bench import infra, workloads


@dataclass
class HostsRun:
    hosts: int
    workers_per_host: int
    n: int
    seconds: float
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per job, by role
    server: dict[str, float] = field(default_factory=dict)  # per job
    ok: bool = True
    claims_by_host: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.n / self.seconds if self.seconds > 0 else float("nan")


def _cpu(clusters: list[infra.Cluster], backend_rows) -> dict[str, float]:
    """CPU seconds so far: django-q2 workers, the clusters' other processes, PG backends."""
    out: dict[str, float] = {"workers": 0.0, "sentinel/monitor/pusher": 0.0}
    for c in clusters:
        for role, value in infra._cpu_by_role(c, []).items():
            if role == "workers":
                out["workers"] += value
            elif role != "postgres backends":
                out["sentinel/monitor/pusher"] += value
    out["postgres backends"] = sum(infra.cpu_seconds(pid) for (pid,) in backend_rows)
    return out


def drain_hosts(hosts: int, workers: int, n: int, user_id: int, timeout: float = 240) -> HostsRun:
    """Enqueue ``n`` summaries, start ``hosts`` clusters at once, time until all are acked."""
    from django.db import connections

    from jobs.models import Attempt

    infra.reset_run_tables()
    workloads.enqueue_summaries(n, user_id)
    connections.close_all()
    infra.vacuum_analyze()
    time.sleep(0.2)
    before = infra.server_counters()
    folders = [tempfile.mkdtemp(prefix=f"bench-host{h}-") for h in range(hosts)]
    with contextlib.ExitStack() as stack:
        watch = stack.enter_context(infra.connect(infra.E2E_DB))
        clusters = [
            stack.enter_context(
                infra.cluster(
                    workers,
                    f"hosts{hosts}-{'abc'[h]}",
                    JOBS_HOST_NAME=f"bench-host-{'abc'[h]}",
                    TMPDIR=folders[h],
                )
            )
            for h in range(hosts)
        ]
        seen = infra.watch_drain(
            watch,
            n,
            cpu=lambda rows: _cpu(clusters, rows),
            alive=lambda: all(c.alive() for c in clusters),
            timeout=timeout,
            failure=lambda left, now: f"{hosts} hosts: {left} of {n} messages left",
        )
    delta = infra.counters_since(before, seen.polls)
    counts = workloads.outcome_counts()
    claims: dict[str, int] = {}
    for worker in Attempt.objects.values_list("worker", flat=True):
        host = worker.split(":", 1)[0]
        claims[host] = claims.get(host, 0) + 1
    connections.close_all()
    return HostsRun(
        hosts,
        workers,
        n,
        seen.seconds,
        cpu_ms=seen.cpu_ms,
        server={k: v / n for k, v in delta.items()},
        ok=counts["succeeded"] == counts["jobs"] == n and counts["effects_applied"] == n,
        claims_by_host=claims,
    )


def run_hosts(user_id: int, *, n: int, workers: int = 1, progress=print) -> list[HostsRun]:
    runs = []
    for hosts in (1, 2, 3):
        r = drain_hosts(hosts, workers, n, user_id)
        runs.append(r)
        cpu = sum(r.cpu_ms.values())
        progress(
            f"hosts: {hosts} x {workers}w: {r.rate:6.1f} jobs/s, CPU {cpu:.1f} ms/job "
            f"(backends {r.cpu_ms.get('postgres backends', 0):.1f}), "
            f"{r.server.get('xact_commit', 0):.1f} commits/job "
            f"({r.server.get('xids', 0):.2f} writing), "
            f"claims {r.claims_by_host}"
            f"{'' if r.ok else ', CHECK FAILED'}"
        )
    return runs


@dataclass
class StoreCost:
    store: str
    n: int
    size: int
    create_ms: list[float]
    read_ms: list[float]

    def summary(self) -> dict:
        return {
            "store": self.store,
            "n": self.n,
            "size": self.size,
            "create_ms_median": statistics.median(self.create_ms),
            "create_ms_p95": sorted(self.create_ms)[int(0.95 * (self.n - 1))],
            "read_ms_median": statistics.median(self.read_ms),
            "read_ms_p95": sorted(self.read_ms)[int(0.95 * (self.n - 1))],
        }


def _store_cost(label: str, n: int, size: int) -> StoreCost:
    """Create ``n`` artifacts of ``size`` bytes exclusively, then read each verified."""
    from jobs import artifacts
    from jobs.models import Artifact, Job

    create, read = [], []
    for i in range(n):
        job = Job(pk=1_000_000 + i, kind="bench.store", output_revision=1)
        data = os.urandom(size)
        t = time.perf_counter()
        stored = artifacts.store(job, data, content_type="application/pdf", extension="pdf")
        create.append((time.perf_counter() - t) * 1000)
        row: Artifact = stored.artifact
        t = time.perf_counter()
        with artifacts.open_verified(row) as fh:
            while fh.read(64 * 1024):
                pass
        read.append((time.perf_counter() - t) * 1000)
    return StoreCost(label, n, size, create, read)


def run_store_costs(*, n: int = 100, size: int = 48 * 1024, progress=print) -> list[dict]:
    """The filesystem store against the S3 store on moto's server, same artifacts."""
    from django.test import override_settings

    from jobs.testing.s3server import moto_server_process

    out = []
    with tempfile.TemporaryDirectory(prefix="bench-fs-") as root:
        fs = {
            "BACKEND": "jobs.artifacts.AtomicFileSystemStorage",
            "OPTIONS": {"location": root},
        }
        from django.conf import settings

        with override_settings(STORAGES={**settings.STORAGES, "artifacts": fs}):
            out.append(_store_cost("filesystem", n, size).summary())
    with moto_server_process(infra.VAR / "moto.log") as server:
        bucket = server.create_bucket("bench-artifacts")
        from django.conf import settings

        s3 = server.storage_options(bucket)
        with override_settings(STORAGES={**settings.STORAGES, "artifacts": s3}):
            out.append(_store_cost("s3 (moto, loopback HTTP)", n, size).summary())
    for s in out:
        progress(
            f"store: {s['store']:26} create {s['create_ms_median']:6.2f} ms "
            f"(p95 {s['create_ms_p95']:6.2f}), verified read {s['read_ms_median']:6.2f} ms "
            f"(p95 {s['read_ms_p95']:6.2f}) per {s['size'] // 1024} KiB artifact"
        )
    return out
