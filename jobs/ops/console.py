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
from datetime import datetime, timedelta

from django.db.models import Count, Max, Q
from django.db.models.functions import Now, TruncMinute
from django.utils import timezone

from jobs import clock, failures, rules, schedules, stats
from jobs.models import EFFECT_STATES, JOB_STATES, Attempt, Effect, EffectEvent, Job
from jobs.ops import verdict
from jobs.ops.error_detail import shown_detail
from jobs.ops.verdict import (  # the verdict's names, where the console's readers look
    FAILED_TRIES,
    WORKER_WINDOW,
    failure_rate,
    health_window,
)
from jobs.ops.verdict import TRIED as TRIED  # re-exported: callers read them here
from jobs.ops.verdict import Health as Health
from jobs.ops.verdict import Reason as Reason
from jobs.ops.verdict import Snapshot as Snapshot
from jobs.ops.verdict import Worker as Worker
from jobs.ops.verdict import health as health
from jobs.ops.verdict import window_words as window_words

RETRY_HORIZON = timedelta(minutes=5)
LIST_LIMIT = 10


def error_of(job: Job, *, detail: bool = False) -> tuple[str, str]:
    """(error class, message) of a job's last error, as operators read it.

    The one place the console and the admin lists read a job's error. With ``detail``
    (the reader holds ``jobs.view_error_detail``: a message may quote data) the message
    is the exception as Python prints it (``KeyError: 'pool'``, ``jobs.failures``), or
    the detail the engine kept; otherwise the code alone: a detail is the raiser's text
    (``PayloadInvalid(f"... {phone}")``), so it is an error detail like any message.
    """
    cls = job.last_error_class or "—"
    if detail and job.last_error_type:
        return cls, failures.headline(job.last_error_type, job.last_error_message)[:300]
    shown = (job.last_error_code, shown_detail(job.kind, job.last_error_detail, allowed=detail))
    return cls, " · ".join(x for x in shown if x)


def recent_failures(limit: int = LIST_LIMIT) -> list[Job]:
    """Dead and failed jobs, the most recent first (what an operator triages)."""
    return list(
        Job.objects.filter(state__in=[Job.State.DEAD, Job.State.FAILED]).order_by(
            "-finished_at", "-updated_at", "-id"
        )[:limit]
    )


def counts(model, states: list[str]) -> list[tuple[str, int]]:
    """(state, count) for every state of ``model``, zeros included, in lifecycle order."""
    found = dict(model.objects.values_list("state").annotate(n=Count("id")).order_by())
    return [(state, found.get(state, 0)) for state in states]


def queue_depth() -> tuple[int, int, int]:
    """The queue's depth where the jobs table is the queue (``jobs.claiming``): waiting and
    running jobs with django-q2's plain messages; running jobs (taken by a cluster) with the
    taken (locked) messages; waiting jobs not yet due."""
    from django_q.models import OrmQ

    jobs = Job.objects.filter(rules.to_q(rules.WAITING) | Q(state=Job.State.RUNNING)).aggregate(
        total=Count("id"),
        taken=Count("id", filter=Q(state=Job.State.RUNNING)),
        later=Count("id", filter=rules.to_q(rules.WAITING) & Q(next_attempt_at__gt=Now())),
    )
    plain = OrmQ.objects.aggregate(total=Count("id"), taken=Count("id", filter=Q(lock__gt=Now())))
    return (
        jobs["total"] + plain["total"],
        jobs["taken"] + plain["taken"],
        jobs["later"],
    )


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


def job_outcomes(minutes: int = 60, *, kind: str = "", now: datetime | None = None) -> list[dict]:
    """Jobs completed (a try succeeded) and tries failed, per minute, optionally one kind."""
    now = (now or timezone.now()).replace(second=0, microsecond=0)
    start = now - timedelta(minutes=minutes - 1)
    tries = Attempt.objects.filter(finished_at__gte=start)
    if kind:
        tries = tries.filter(job__kind=kind)

    def per_minute(qs) -> dict:
        return dict(
            qs.annotate(minute=TruncMinute("finished_at"))
            .values_list("minute")
            .annotate(n=Count("id"))
            .order_by()
        )

    done = per_minute(tries.filter(outcome=Attempt.Outcome.SUCCEEDED))
    failed = per_minute(tries.filter(outcome__in=FAILED_TRIES))
    return [
        {
            "minute": start + timedelta(minutes=i),
            "completed": done.get(start + timedelta(minutes=i), 0),
            "failed": failed.get(start + timedelta(minutes=i), 0),
        }
        for i in range(minutes)
    ]


def kinds() -> list[str]:
    """Job kinds present, for the chart's filter."""
    return list(Job.objects.values_list("kind", flat=True).distinct().order_by("kind"))


def snapshot(now: datetime | None = None) -> Snapshot:
    """Everything the console shows, stamped ``now`` (the chart's last minute, ages)."""
    now = now or timezone.now()
    depth, taken, later = queue_depth()
    horizon = clock.after(RETRY_HORIZON.total_seconds())
    due_soon = Job.objects.filter(
        state=Job.State.RETRY_WAIT, next_attempt_at__lte=horizon
    ).order_by("next_attempt_at", "id")
    needs_review = Effect.objects.filter(state=Effect.State.NEEDS_REVIEW).order_by(
        "updated_at", "id"
    )
    window = health_window()
    failed, finished = failure_rate(window)
    last_failed, last_succeeded, since_failure = verdict.last_tries(window)
    return Snapshot(
        now=now,
        jobs=counts(Job, JOB_STATES),
        effects=counts(Effect, EFFECT_STATES),
        queue_depth=depth,
        queue_taken=taken,
        queue_later=later,
        oldest_due_at=Job.objects.filter(rules.to_q(rules.JOB_DUE))
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
        failed_tries=failed,
        finished_tries=finished,
        stopped_recently=Job.objects.filter(
            state__in=[Job.State.DEAD, Job.State.FAILED],
            finished_at__gte=clock.before(window.total_seconds()),
        ).count(),
        failures=recent_failures(),
        failures_count=Job.objects.filter(state__in=[Job.State.DEAD, Job.State.FAILED]).count(),
        window=window,
        stoppers=verdict.stoppers(),
        queues=verdict.queues(),
        failing_subjects=verdict.failing_subjects(window),
        last_failed_at=last_failed,
        last_succeeded_at=last_succeeded,
        succeeded_since_failure=since_failure,
        retrying_same=verdict.retrying_on_the_same_error(LIST_LIMIT),
        schedules=schedules.overview()[0],
        listening=listening_workers(),
    )


LISTENER_NAME = "django-q2 listener %"  # the application_name of a waiting worker's listener


def listening_workers() -> int | None:
    """Worker connections waiting for work on this database (PostgreSQL: the broker's
    listeners, by their ``application_name``); None where the database cannot tell.

    What says an idle worker is alive: one that serves only queues with nothing due claims
    nothing and sends nothing, yet it is there (the console must not say "0 workers").
    """
    from django.db import DatabaseError, connection

    if connection.vendor != "postgresql":
        return None
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name LIKE %s",
                [LISTENER_NAME],
            )
            return int(cursor.fetchone()[0])
    except DatabaseError:  # no right to read the view: say nothing rather than fail the page
        return None


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


OUTCOME_SERIES = ("completed", "failed")


def chart(rows: list[dict], series: tuple[str, ...] = SERIES) -> dict:
    """Geometry of the per-minute chart: polylines, axes and tick labels in SVG units."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top = nice_ceiling(max([0] + [r[k] for r in rows for k in series]))
    step = plot_w / max(1, len(rows) - 1)

    def x(i: int) -> float:
        return LEFT + i * step

    def y(value: float) -> float:
        return TOP + plot_h - value * plot_h / top

    lines = {
        key: " ".join(f"{x(i):.1f},{y(r[key]):.1f}" for i, r in enumerate(rows)) for key in series
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
