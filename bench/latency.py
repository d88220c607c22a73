"""Enqueue-to-outcome latency under a running cluster: idle single jobs and 83-job bursts.

One cluster (the production worker count) serves three measurements: single
jobs enqueued into an idle cluster (bounded below by ``Q_CLUSTER['poll']``),
a burst of 83 minimal jobs whose notice is in-app, and a burst of 83 jobs
whose notice goes over HTTP to the stand-in provider (``manage.py
fake_provider`` on loopback) with its idempotency key. Times are the workers'
own database timestamps minus the commit instant of the enqueueing
transaction, all on this host's clock.
"""

from __future__ import annotations

import contextlib
import math
import random
import socket
import time
import uuid
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

import jobs
from bench import infra, workloads
from jobs.contrib.drills import burst
from jobs.models import Effect, Job, Notice

BURST = 83


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


@dataclass
class Series:
    label: str
    values_ms: list[float] = field(default_factory=list)
    note: str = ""

    def p(self, q: float) -> float:
        return pct(self.values_ms, q)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def stand_in_provider():
    """The loopback stand-in of the notice provider, as its own process."""
    port = _free_port()
    record = infra.VAR / f"provider-{uuid.uuid4().hex[:6]}.sqlite3"
    (infra.VAR / "fake-provider.log").unlink(missing_ok=True)
    procs = infra.processes()
    proc = procs.start(
        "fake-provider", "fake_provider", "--port", str(port), "--record", str(record)
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    "the stand-in provider did not start (var/bench/fake-provider.log)"
                )
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        procs.terminate(proc, timeout=5)
        with contextlib.suppress(OSError):
            for suffix in ("", "-wal", "-shm"):
                record.with_name(record.name + suffix).unlink()


def _wait(what: str, check, c: infra.Cluster, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if not c.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"latency: timed out waiting for {what}\n{c.log_tail()}")
        time.sleep(0.01)


def _enqueue(kind: str, n: int, user_id: int, tag: str, **params) -> tuple[list[int], object]:
    """Enqueue ``n`` jobs in one transaction; return their ids and the commit instant."""
    with transaction.atomic():
        ids = [
            jobs.request(
                kind, ("bench.latency", f"{tag}-{i}"), tenant="bench", params=params
            ).job.pk
            for i in range(n)
        ]
    return ids, timezone.now()


def _ms(later, earlier) -> float:
    return (later - earlier).total_seconds() * 1000


def run(user_id: int, workers: int, *, singles: int = 20, progress=print) -> dict[str, Series]:
    infra.reset_run_tables()
    out: dict[str, Series] = {}
    with (
        stand_in_provider() as url,
        # DEBUG is off in the cluster, as in production: a provider URL needs its token.
        infra.cluster(
            workers, "latency", NOTICE_PROVIDER_URL=url, NOTICE_PROVIDER_TOKEN="bench-stand-in"
        ) as c,
    ):
        # Warm up: the cluster is up and every worker has connected once.
        ids, _ = _enqueue(workloads.SUMMARY, workers * 2, user_id, "warm", notify_user_id=user_id)
        _wait(
            "warm-up jobs",
            lambda: Job.objects.filter(pk__in=ids, state=Job.State.SUCCEEDED).count() == len(ids),
            c,
        )

        idle = Series("idle single job: enqueue → succeeded")
        rng = random.Random(3)
        for k in range(singles):
            time.sleep(0.25 + rng.random() * 0.5)  # land anywhere in the poll cycle
            [pk], at = _enqueue(workloads.SUMMARY, 1, user_id, f"single{k}", notify_user_id=user_id)
            _wait("a single job", lambda pk=pk: _done(pk), c)
            idle.values_ms.append(_ms(Job.objects.get(pk=pk).finished_at, at))
        out["idle"] = idle
        progress(f"latency: idle single job p50 {idle.p(50):.1f} ms")

        ids, at = _enqueue(workloads.SUMMARY, BURST, user_id, "inapp", notify_user_id=user_id)
        _wait(
            "the in-app burst",
            lambda: Notice.objects.filter(effect__job_id__in=ids).count() == BURST,
            c,
        )
        out["inapp_succeeded"], out["inapp_notice"] = _burst_series(ids, at, "in-app")
        progress(f"latency: in-app burst p95 {out['inapp_notice'].p(95):.0f} ms to notice")

        ids, at = _enqueue(
            burst.KIND, BURST, user_id, "webhook", recipient=user_id, provider="webhook"
        )
        try:
            _wait(
                "the webhook burst",
                lambda: (
                    Effect.objects.filter(job_id__in=ids, state=Effect.State.APPLIED).count()
                    == BURST
                ),
                c,
                timeout=120,
            )
        except RuntimeError as exc:
            note = str(exc).splitlines()[0]
            out["webhook_succeeded"] = Series("webhook burst: enqueue → succeeded", note=note)
            out["webhook_notice"] = Series("webhook burst: enqueue → notice", note=note)
        else:
            out["webhook_succeeded"], out["webhook_notice"] = _burst_series(ids, at, "webhook")
            progress(f"latency: webhook burst p95 {out['webhook_notice'].p(95):.0f} ms to notice")
    return out


def _done(pk: int) -> bool:
    return Job.objects.filter(pk=pk, state=Job.State.SUCCEEDED).exists()


def _burst_series(ids: list[int], at, label: str) -> tuple[Series, Series]:
    done = Series(f"{label} burst of {BURST}: enqueue → succeeded")
    notice = Series(f"{label} burst of {BURST}: enqueue → notice applied")
    finished = dict(Job.objects.filter(pk__in=ids).values_list("pk", "finished_at"))
    applied = dict(
        Effect.objects.filter(job_id__in=ids)
        .values("job_id")
        .annotate(at=Max("applied_at"))
        .values_list("job_id", "at")
    )
    for pk in ids:
        done.values_ms.append(_ms(finished[pk], at))
        notice.values_ms.append(_ms(applied[pk], at))
    return done, notice
