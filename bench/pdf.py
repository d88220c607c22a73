"""Milliseconds to render one permit report PDF (``permits.reports.render_report``)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from bench.latency import pct
from jobs.models import Job
from permits import reports
from permits.management.commands.seed_demo import EPOCH
from permits.models import PermitRequest


@dataclass
class Render:
    renders: int
    median_ms: float
    p95_ms: float
    size_bytes: int


def run(rounds: int = 4) -> Render:
    """Render every seeded permit ``rounds`` times (after one warm-up pass)."""
    permits = list(PermitRequest.objects.select_related("tenant").order_by("pk"))
    job = Job(pk=84, kind=reports.KIND, output_revision=29, created_at=EPOCH)
    sizes, samples = [], []
    for permit in permits:  # warm-up: fonts, styles, imports
        reports.render_report(permit, job)
    for _ in range(rounds):
        for permit in permits:
            t = time.perf_counter()
            pdf = reports.render_report(permit, job)
            samples.append((time.perf_counter() - t) * 1000)
            sizes.append(len(pdf))
    return Render(
        len(samples), statistics.median(samples), pct(samples, 95), int(statistics.median(sizes))
    )
