"""Small trend lines beside the verdict: did the fix work, is the queue draining?

Per minute over the last ``TREND_MINUTES``, read from the record in two queries: failed
tries (attempt rows), and the jobs waiting for their first try with the oldest such wait
(a job waits from ``created_at`` until ``started_at``, its first claim, or until it
finished without one). A retry's wait is not in these lines: the record keeps when a try
ended, not when its retry became due. Reads only.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count, Min, Q
from django.db.models.functions import TruncMinute
from django.utils import timezone

from jobs.models import Attempt, Job
from jobs.ops.verdict import FAILED_TRIES
from jobs.ops.words import duration

TREND_MINUTES = 30
WIDTH, HEIGHT, PAD = 160, 36, 3


@dataclass(frozen=True)
class Trend:
    """One sparkline: its values per minute, the polyline and its words."""

    key: str
    title: str
    values: list[float]
    points: str
    now_text: str
    top_text: str


def _points(values: list[float]) -> str:
    top = max(values) or 1.0
    step = (WIDTH - 2 * PAD) / max(1, len(values) - 1)
    return " ".join(
        f"{PAD + i * step:.1f},{HEIGHT - PAD - v * (HEIGHT - 2 * PAD) / top:.1f}"
        for i, v in enumerate(values)
    )


def trends(now: datetime | None = None, minutes: int = TREND_MINUTES) -> list[Trend]:
    """Failed tries per minute, jobs waiting for a first try, and the oldest such wait."""
    now = (now or timezone.now()).replace(second=0, microsecond=0)
    ends = [now - timedelta(minutes=minutes - 1 - i) for i in range(minutes)]
    failed = dict(
        Attempt.objects.filter(finished_at__gte=ends[0], outcome__in=FAILED_TRIES)
        .annotate(minute=TruncMinute("finished_at"))
        .values_list("minute")
        .annotate(n=Count("id"))
        .order_by()
    )
    failed_values = [float(failed.get(m, 0)) for m in ends]
    first = ends[0]
    candidates = Job.objects.filter(
        Q(started_at__isnull=True) | Q(started_at__gt=first),
        Q(finished_at__isnull=True) | Q(finished_at__gt=first),
        created_at__lte=now + timedelta(minutes=1),
    )
    figures = {}
    for i, end in enumerate(ends):
        at = end + timedelta(minutes=1)  # the end of that minute
        waiting = (
            Q(created_at__lte=at)
            & (Q(started_at__isnull=True) | Q(started_at__gt=at))
            & (Q(finished_at__isnull=True) | Q(finished_at__gt=at))
        )
        figures[f"n{i}"] = Count("id", filter=waiting)
        figures[f"o{i}"] = Min("created_at", filter=waiting)
    found = candidates.aggregate(**figures) if figures else {}
    depth = [float(found.get(f"n{i}") or 0) for i in range(minutes)]
    oldest = []
    for i, end in enumerate(ends):
        since = found.get(f"o{i}")
        at = end + timedelta(minutes=1)
        oldest.append(max((at - since).total_seconds(), 0.0) if since else 0.0)
    span = f"the last {minutes} min"
    highest = max(oldest)
    if highest > minutes * 60:
        # A job older than the window (a seeded or long-forgotten one): its age, said as an
        # age, not as "the longest wait in the last 30 minutes was 29 d".
        oldest_top = (
            f"the oldest has waited {duration(timedelta(seconds=highest))} since it was asked for"
        )
    else:
        oldest_top = f"highest {duration(timedelta(seconds=highest))} in {span}"
    return [
        Trend(
            "failed-tries",
            f"Failed tries per minute, {span}",
            failed_values,
            _points(failed_values),
            f"{failed_values[-1]:.0f} this minute",
            f"most {max(failed_values):.0f}",
        ),
        Trend(
            "queue-depth",
            f"Jobs waiting for a first try, {span}",
            depth,
            _points(depth),
            f"{depth[-1]:.0f} now",
            f"most {max(depth):.0f}",
        ),
        Trend(
            "oldest-wait",
            f"Oldest wait for a first try, {span}",
            oldest,
            _points(oldest),
            f"{duration(timedelta(seconds=oldest[-1]))} now",
            oldest_top,
        ),
    ]
