"""What the operations console shows, read from the engine's tables in a few queries.

Every figure comes from the rows that are the record (jobs, attempts, ledger,
django-q2's ORM queue), so the console agrees with the database by construction:
counts per state list every state, zeros included, so an empty state is visible
as 0 rather than missing. Windows ("the last minute", "the next 5 minutes", "due")
are judged by the database server's clock, like the engine's own (``jobs.clock``);
the times shown are only for people. Reads only; the console changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Count, Max, Q
from django.db.models.functions import Now, TruncMinute
from django.utils import timezone

from jobs import clock, stats
from jobs.models import EFFECT_STATES, JOB_STATES, Attempt, Effect, EffectEvent, Job

WORKER_WINDOW = timedelta(minutes=1)
RETRY_HORIZON = timedelta(minutes=5)
LIST_LIMIT = 10


@dataclass
class Worker:
    """A worker identity seen lately: by its deliveries, its sends, or its leases."""

    identity: str
    last_seen: datetime
    deliveries: int = 0
    sends: int = 0
    running: int = 0
    last_heartbeat: datetime | None = None


@dataclass
class Snapshot:
    now: datetime
    jobs: list[tuple[str, int]]
    effects: list[tuple[str, int]]
    queue_depth: int
    queue_taken: int
    oldest_due_at: datetime | None
    workers: list[Worker]
    retries_due: list[Job]
    retries_due_count: int
    effect_retries_due_count: int
    needs_review: list[Effect]
    needs_review_count: int
    failed_deliveries: int = 0
    timeline: list[dict] = field(default_factory=list)

    @property
    def oldest_due_age(self) -> timedelta | None:
        return (
            None if self.oldest_due_at is None else max(self.now - self.oldest_due_at, timedelta())
        )


def counts(model, states: list[str]) -> list[tuple[str, int]]:
    """(state, count) for every state of ``model``, zeros included, in lifecycle order."""
    found = dict(model.objects.values_list("state").annotate(n=Count("id")).order_by())
    return [(state, found.get(state, 0)) for state in states]


def queue_depth() -> tuple[int, int]:
    """Messages in django-q2's ORM queue, and how many a cluster has taken (locked)."""
    from django_q.models import OrmQ

    figures = OrmQ.objects.aggregate(total=Count("id"), taken=Count("id", filter=Q(lock__gt=Now())))
    return figures["total"], figures["taken"]


def workers_seen(window: timedelta = WORKER_WINDOW) -> list[Worker]:
    """Worker identities active in ``window``: deliveries, effect sends and live leases.

    A running job's ``updated_at`` moves with every transition of its owner,
    heartbeats included, so its latest value is the owner's last heartbeat.
    """
    since = clock.before(window.total_seconds())
    seen: dict[str, Worker] = {}

    def worker(identity: str, at: datetime) -> Worker:
        w = seen.setdefault(identity, Worker(identity, at))
        w.last_seen = max(w.last_seen, at)
        return w

    attempts = (
        Attempt.objects.filter(Q(started_at__gte=since) | Q(finished_at__gte=since))
        .values("worker")
        .annotate(n=Count("id"), started=Max("started_at"), finished=Max("finished_at"))
        .order_by()
    )
    for row in attempts:
        last = max(t for t in (row["started"], row["finished"]) if t is not None)
        worker(row["worker"], last).deliveries = row["n"]
    sends = (
        EffectEvent.objects.filter(at__gte=since)
        .exclude(actor__startswith="operator:")
        .values("actor")
        .annotate(n=Count("id"), last=Max("at"))
        .order_by()
    )
    for row in sends:
        worker(row["actor"], row["last"]).sends = row["n"]
    leases = (
        Job.objects.filter(state=Job.State.RUNNING, updated_at__gte=since)
        .values("lease_owner")
        .annotate(n=Count("id"), beat=Max("updated_at"))
        .order_by()
    )
    for row in leases:
        w = worker(row["lease_owner"], row["beat"])
        w.running, w.last_heartbeat = row["n"], row["beat"]
    return sorted(seen.values(), key=lambda w: w.last_seen, reverse=True)


def timeline(minutes: int = 60, *, now: datetime | None = None) -> list[dict]:
    """Deliveries, duplicate deliveries and applied effects per minute, the last ``minutes``."""
    now = (now or timezone.now()).replace(second=0, microsecond=0)
    start = now - timedelta(minutes=minutes - 1)

    def per_minute(qs, stamp: str) -> dict:
        return dict(
            qs.filter(**{f"{stamp}__gte": start})
            .annotate(minute=TruncMinute(stamp))
            .values_list("minute")
            .annotate(n=Count("id"))
            .order_by()
        )

    deliveries = per_minute(Attempt.objects.all(), "started_at")
    duplicates = per_minute(
        Attempt.objects.filter(outcome=Attempt.Outcome.DUPLICATE_DELIVERY), "started_at"
    )
    effects = per_minute(Effect.objects.all(), "applied_at")
    rows = []
    for i in range(minutes):
        minute = start + timedelta(minutes=i)
        rows.append(
            {
                "minute": minute,
                "deliveries": deliveries.get(minute, 0),
                "duplicates": duplicates.get(minute, 0),
                "effects": effects.get(minute, 0),
            }
        )
    return rows


def snapshot(now: datetime | None = None) -> Snapshot:
    """Everything the console shows, stamped ``now`` (the chart's last minute, ages)."""
    now = now or timezone.now()
    depth, taken = queue_depth()
    horizon = clock.after(RETRY_HORIZON.total_seconds())
    due_soon = Job.objects.filter(
        state=Job.State.RETRY_WAIT, next_attempt_at__lte=horizon
    ).order_by("next_attempt_at", "id")
    needs_review = Effect.objects.filter(state=Effect.State.NEEDS_REVIEW).order_by(
        "updated_at", "id"
    )
    return Snapshot(
        now=now,
        jobs=counts(Job, JOB_STATES),
        effects=counts(Effect, EFFECT_STATES),
        queue_depth=depth,
        queue_taken=taken,
        oldest_due_at=Job.objects.due()
        .order_by("next_attempt_at")
        .values_list("next_attempt_at", flat=True)
        .first(),
        workers=workers_seen(),
        retries_due=list(due_soon[:LIST_LIMIT]),
        retries_due_count=due_soon.count(),
        effect_retries_due_count=Effect.objects.filter(
            state__in=[Effect.State.PENDING, Effect.State.UNKNOWN],
            attempts__gt=0,
            next_attempt_at__lte=horizon,
        ).count(),
        needs_review=list(needs_review.select_related("job")[:LIST_LIMIT]),
        needs_review_count=needs_review.count(),
        failed_deliveries=sum(stats.failed_deliveries().values()),
        timeline=timeline(60, now=now),
    )


# --- the chart ------------------------------------------------------------------------

# The SVG's own coordinate system; CSS scales it to the page's width (no fixed pixels).
WIDTH, HEIGHT = 760, 260
LEFT, RIGHT, TOP, BOTTOM = 52, 30, 14, 40
SERIES = ("deliveries", "duplicates", "effects")


def nice_ceiling(value: int) -> int:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value`` (at least 1)."""
    if value <= 1:
        return 1
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * power >= value:
            return step * power
    return 10 * power


def chart(rows: list[dict]) -> dict:
    """Geometry of the per-minute chart: polylines, axes and tick labels in SVG units."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top = nice_ceiling(max([0] + [r[k] for r in rows for k in SERIES]))
    step = plot_w / max(1, len(rows) - 1)

    def x(i: int) -> float:
        return LEFT + i * step

    def y(value: float) -> float:
        return TOP + plot_h - value * plot_h / top

    lines = {
        key: " ".join(f"{x(i):.1f},{y(r[key]):.1f}" for i, r in enumerate(rows)) for key in SERIES
    }
    y_ticks = [
        {"y": round(y(v), 1), "label": v} for v in ([0, top] if top < 2 else [0, top // 2, top])
    ]
    x_ticks = [
        {"x": round(x(i), 1), "label": r["minute"].strftime("%H:%M")}
        for i, r in enumerate(rows)
        if i % 10 == 0 or i == len(rows) - 1
    ]
    return {
        "width": WIDTH,
        "height": HEIGHT,
        "left": LEFT,
        "right": WIDTH - RIGHT,
        "top": TOP,
        "bottom": HEIGHT - BOTTOM,
        "top_value": top,
        "lines": lines,
        "y_ticks": y_ticks,
        "x_ticks": x_ticks,
        "x_label_y": HEIGHT - BOTTOM + 18,
        "axis_title_y": HEIGHT - 4,
        "mid_x": LEFT + plot_w / 2,
    }
