"""The console's verdict: what stops work, how many tries failed lately, who fails alone.

Judged over a short recent window, ``JOBS_CONSOLE_WINDOW_SECONDS`` (default 300 s), by
the database server's clock: a fix shows as "Recovering" at the next success and as
"Healthy" once the window has passed the last failure (docs/app/console.md). One
subject failing every try is named instead of turning the whole system red. Reads only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Count, F, Max, Min, Q
from django.utils import timezone

from jobs import clock, rules
from jobs.models import Attempt, Effect, FlowRule, Job
from jobs.ops.words import duration

WORKER_WINDOW = timedelta(minutes=1)
# A claim elsewhere this long after a queue's oldest came due: workers pass that queue by.
PASSED_BY_MARGIN = timedelta(seconds=3)
# The verdict judges the last JOBS_CONSOLE_WINDOW_SECONDS (docs/app/console.md): short, so
# it says "Recovering" once failures stop and "Healthy" when the window has passed them.
DEFAULT_WINDOW_SECONDS = 300


def health_window() -> timedelta:
    """The verdict's window: ``JOBS_CONSOLE_WINDOW_SECONDS`` (default 300 s, at least 1 s)."""
    from jobs import conf

    seconds = float(conf.get("JOBS_CONSOLE_WINDOW_SECONDS"))
    return timedelta(seconds=max(1.0, seconds))


def window_words(window: timedelta) -> str:
    """``5 min``, ``30 s``: the window as the verdict's lines say it."""
    seconds = int(window.total_seconds())
    return f"{seconds // 60} min" if seconds % 60 == 0 else f"{seconds} s"


# Thresholds of the health line (docs/ui.md): a share of tries that failed, a wait.
FAILING_RATE, DEGRADED_RATE = 0.5, 0.1
FAILING_WAIT, DEGRADED_WAIT = timedelta(minutes=5), timedelta(minutes=1)
TRIED = (
    Attempt.Outcome.SUCCEEDED,
    Attempt.Outcome.RETRY,
    Attempt.Outcome.FAILED,
    Attempt.Outcome.DEAD,
    Attempt.Outcome.CRASHED,
    Attempt.Outcome.LEASE_LOST,
)
FAILED_TRIES = (
    Attempt.Outcome.RETRY,
    Attempt.Outcome.FAILED,
    Attempt.Outcome.DEAD,
    Attempt.Outcome.CRASHED,
)


@dataclass(frozen=True)
class Reason:
    """One figure of the health line: what it measures, its value in words, its level."""

    key: str  # paused, circuit, queue-idle, one-subject, failure-rate, oldest-due, ...
    level: str  # ok, warn, bad
    text: str
    link: str = ""  # admin list behind the figure (a URL name and query), "" for none
    href: str = ""  # the one action that fixes it, when it is a page (a built URL)
    action: str = ""  # the one action that fixes it, when it is a button: "resume"
    scope: str = ""  # the flow scope the button acts on
    action_label: str = ""
    command: str = ""  # the one action that fixes it, when it is a shell command


@dataclass(frozen=True)
class Stopper:
    """Something that stops work by itself: a paused scope or an open circuit."""

    scope: str
    what: str  # "paused" | "circuit"
    since: datetime | None
    waiting: int  # jobs or effects held behind it
    oldest_waiting_at: datetime | None
    provider: str = ""


@dataclass(frozen=True)
class QueueView:
    """One queue's depth, oldest wait and whether any worker claimed from it lately."""

    name: str
    waiting: int
    due: int
    oldest_due_at: datetime | None
    claimed_recently: bool
    oldest_wait: timedelta | None = None  # the oldest due job's wait, at the read
    # Workers claimed other queues' work that came due after this queue's oldest: they
    # are alive and pass it by, so no worker serves it (known at once, no minute's wait).
    passed_by: bool = False

    @property
    def serve_command(self) -> str:
        """The command that starts a worker for this queue."""
        return f"manage.py jobs_worker --queue {self.name}"


@dataclass(frozen=True)
class FailingSubject:
    """A subject whose jobs failed tries in the window."""

    subject_type: str
    subject_id: str
    failed: int
    succeeded: int
    job_id: int


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
    queue_later: int = 0  # messages sent ahead, held for their job's due time
    timeline: list[dict] = field(default_factory=list)
    failed_tries: int = 0
    finished_tries: int = 0
    stopped_recently: int = 0
    failures: list[Job] = field(default_factory=list)
    failures_count: int = 0
    window: timedelta = timedelta(seconds=DEFAULT_WINDOW_SECONDS)
    stoppers: list[Stopper] = field(default_factory=list)
    queues: list[QueueView] = field(default_factory=list)
    failing_subjects: list[FailingSubject] = field(default_factory=list)
    last_failed_at: datetime | None = None
    last_succeeded_at: datetime | None = None
    succeeded_since_failure: int = 0
    retrying_same: list[tuple[Job, int]] = field(default_factory=list)
    # Periodic kinds (jobs.schedules.overview): last requested and next tick, paused.
    schedules: list = field(default_factory=list)
    # Worker processes connected and waiting for work (PostgreSQL's listeners); None
    # where the database cannot tell (an idle worker then leaves no trace).
    listening: int | None = None

    @property
    def oldest_due_age(self) -> timedelta | None:
        return (
            None if self.oldest_due_at is None else max(self.now - self.oldest_due_at, timedelta())
        )


LEVEL_WORDS = {"ok": "OK", "warn": "Warning", "bad": "Problem"}


@dataclass(frozen=True)
class Health:
    """The console's first line: healthy, degraded or failing, and why."""

    status: str  # healthy, degraded, failing
    reasons: list[Reason]

    @property
    def problems(self) -> list[Reason]:
        return [r for r in self.reasons if r.level != "ok"]


def failure_rate(window: timedelta | None = None) -> tuple[int, int]:
    """(failed tries, finished tries) in ``window``: a retry, failure, death or crash is a
    failed try; duplicate deliveries and deferrals are no tries."""
    since = clock.before((window or health_window()).total_seconds())
    figures = Attempt.objects.filter(finished_at__gte=since, outcome__in=TRIED).aggregate(
        n=Count("id"), bad=Count("id", filter=Q(outcome__in=FAILED_TRIES))
    )
    return figures["bad"], figures["n"]


def _ago(delta: timedelta) -> str:
    return duration(delta)


def health(snap: Snapshot) -> Health:
    """Judge the snapshot: what stops work comes first (a paused scope, an open circuit, a
    queue nobody claims from), each with the one action that fixes it; then the share of
    tries that failed in the window, not counting one subject that fails on its own (it
    is named instead); "recovering" once no try failed since the last success; failing,
    degraded or healthy otherwise. Every figure is listed with its level, problems first."""
    window = window_words(snap.window)
    recovering = (
        snap.failed_tries > 0
        and snap.last_succeeded_at is not None
        and snap.last_failed_at is not None
        and snap.last_succeeded_at > snap.last_failed_at
    )
    reasons = [
        *_stopper_reasons(snap),
        *queue_reasons(snap),
        *_try_reasons(snap, window, recovering),
        *_wait_reasons(snap, window),
    ]
    levels = {r.level for r in reasons}
    if "bad" in levels:
        status = "failing"
    elif recovering:
        status = "recovering"
    else:
        status = "degraded" if "warn" in levels else "healthy"
    order = {"bad": 0, "warn": 1, "ok": 2}
    return Health(status, sorted(reasons, key=lambda r: order[r.level]))


def _try_reasons(snap: Snapshot, window: str, recovering: bool) -> list[Reason]:
    """Recovery, the one subject failing alone, and the share of the other tries failed."""
    reasons = []
    if recovering:
        clears = snap.last_failed_at + snap.window
        reasons.append(
            Reason(
                "recovering",
                "warn",
                f"No try has failed since {_clock(snap.last_failed_at)} "
                f"({snap.succeeded_since_failure} succeeded since); healthy at "
                f"{_clock(clears)} if none fails",
            )
        )
    bad, tried = snap.failed_tries, snap.finished_tries
    alone = snap.failing_subjects[0] if len(snap.failing_subjects) == 1 else None
    if alone is not None:  # one subject failing on its own is named, not the system
        reasons.append(_one_subject_reason(alone, window))
        bad, tried = bad - alone.failed, tried - alone.failed - alone.succeeded
    if tried <= 0:
        other = " other" if alone is not None else ""
        reasons.append(
            Reason("failure-rate", "ok", f"No{other} tries finished in the last {window}")
        )
        return reasons
    rate = bad / tried
    level = "bad" if rate >= FAILING_RATE else "warn" if rate >= DEGRADED_RATE else "ok"
    if recovering and level != "ok":
        level = "warn"
    reasons.append(
        Reason(
            "failure-rate",
            level,
            f"{rate:.0%} of tries failed in the last {window} ({bad} of {tried})",
            "admin:jobs_attempt_changelist",
        )
    )
    return reasons


def _wait_reasons(snap: Snapshot, window: str) -> list[Reason]:
    """The oldest due job, effects to review, workers, jobs retrying or stopped lately."""
    reasons = []
    age = snap.oldest_due_age
    if age is None:
        reasons.append(Reason("oldest-due", "ok", "Nothing is waiting to run"))
    else:
        waiting_long = age >= FAILING_WAIT and not snap.workers
        level = "bad" if waiting_long else "warn" if age >= DEGRADED_WAIT else "ok"
        reasons.append(Reason("oldest-due", level, f"Oldest due job has waited {_ago(age)}"))
    n = snap.needs_review_count
    reasons.append(
        Reason(
            "needs-review",
            "warn" if n else "ok",
            f"{n} effect{'s' if n != 1 else ''} need{'s' if n == 1 else ''} review",
            "admin:jobs_effect_changelist",
        )
    )
    reasons.append(_workers_reason(snap))
    if snap.retrying_same:
        k = len(snap.retrying_same)
        reasons.append(
            Reason(
                "retrying-same",
                "warn",
                f"{k} job{'s' if k != 1 else ''} retrying on the same error "
                "(listed with the dead and failed jobs)",
            )
        )
    if snap.stopped_recently:
        k = snap.stopped_recently
        reasons.append(
            Reason(
                "stopped",
                "warn",
                f"{k} job{'s' if k != 1 else ''} failed or died in the last {window}",
            )
        )
    return reasons


def _workers_reason(snap: Snapshot) -> Reason:
    """Workers by what they did in the last minute; idle ones by their open listener.

    "0 workers" is said only when none is alive: workers that wait for work (each keeps a
    listener connection on PostgreSQL) are alive even when the only due work is in a queue
    they do not serve (that queue has its own line, with the command that serves it).
    """
    workers = len(snap.workers)
    due = snap.oldest_due_at is not None
    if workers:
        return Reason(
            "workers",
            "ok",
            f"{workers} worker{'s' if workers != 1 else ''} seen in the last minute",
        )
    if snap.listening:
        n = snap.listening
        return Reason(
            "workers",
            "ok",
            f"{n} worker{'s' if n != 1 else ''} connected and waiting for work"
            + ("; none claimed in the last minute" if due else ""),
        )
    if not due:
        return Reason("workers", "ok", "0 workers seen in the last minute, nothing is due")
    return Reason(
        "workers",
        "bad",
        "No worker is running while jobs are due: start one with manage.py jobs_worker",
        command="manage.py jobs_worker",
    )


def _clock(at: datetime) -> str:
    return timezone.localtime(at).strftime("%H:%M:%S")


def _stopper_reasons(snap: Snapshot) -> list[Reason]:
    from django.urls import reverse

    found = []
    for stop in snap.stoppers:
        held = ""
        if stop.waiting:
            noun = "effect" if stop.provider else "job"
            held = f"; {stop.waiting} {noun}{'s' if stop.waiting != 1 else ''} waiting"
            if stop.oldest_waiting_at is not None:
                held += (
                    f", the oldest for {_ago(max(snap.now - stop.oldest_waiting_at, timedelta()))}"
                )
        since = f" since {_clock(stop.since)}" if stop.since else ""
        if stop.what == "paused":
            found.append(
                Reason(
                    "paused",
                    "bad",
                    f"{stop.scope} is paused{since}{held}",
                    action="resume",
                    scope=stop.scope,
                    action_label=f"Resume {stop.scope}",
                )
            )
        else:
            url = reverse("admin:jobs_effect_changelist") + f"?provider__exact={stop.provider}"
            found.append(
                Reason(
                    "circuit",
                    "bad",
                    f"Provider {stop.provider}: circuit open{since}{held}",
                    href=url,
                    action_label=f"Open {stop.provider}'s effects",
                )
            )
    return found


def queue_reasons(snap: Snapshot) -> list[Reason]:
    found = []
    for q in snap.queues:
        if not q.due or q.claimed_recently or q.oldest_due_at is None:
            continue
        waited = max(snap.now - q.oldest_due_at, timedelta())
        if not q.passed_by and waited < WORKER_WINDOW:
            continue  # due just now, and no worker has passed it by yet
        found.append(
            Reason(
                "queue-idle",
                "bad",
                f"Queue {q.name}: {q.due} due, the oldest waiting {_ago(waited)}; no "
                f"worker serves this queue. Start one with {q.serve_command}",
                command=q.serve_command,
            )
        )
    return found


def _one_subject_reason(alone: FailingSubject, window: str) -> Reason:
    from django.apps import apps
    from django.urls import reverse

    from jobs.hooks import subject_labels

    stub = Job(subject_type=alone.subject_type, subject_id=alone.subject_id)
    label = subject_labels([stub]).get((alone.subject_type, alone.subject_id))
    label = label or f"{alone.subject_type}:{alone.subject_id}"
    try:
        noun = str(apps.get_model(alone.subject_type)._meta.verbose_name)
    except (LookupError, ValueError):
        noun = "subject"
    tries = f"{alone.failed} tr{'y' if alone.failed == 1 else 'ies'}"
    how = "fails every try" if not alone.succeeded else f"failed {tries}"
    return Reason(
        "one-subject",
        "warn",
        f"1 {noun} {how}: {label} ({alone.failed} in the last {window}); the rest is judged "
        "without it",
        href=reverse("admin:jobs_job_change", args=[alone.job_id]),
        action_label=f"Open job {alone.job_id}",
    )


def last_tries(window: timedelta) -> tuple[datetime | None, datetime | None, int]:
    """(last failed try, last succeeded try, tries succeeded since the last failure) in
    the window: a success after the last failure is the first sign of recovery."""
    tries = Attempt.objects.filter(finished_at__gte=clock.before(window.total_seconds()))
    figures = tries.aggregate(
        failed=Max("finished_at", filter=Q(outcome__in=FAILED_TRIES)),
        succeeded=Max("finished_at", filter=Q(outcome=Attempt.Outcome.SUCCEEDED)),
    )
    since = 0
    if figures["failed"] is not None:
        since = tries.filter(
            outcome=Attempt.Outcome.SUCCEEDED, finished_at__gt=figures["failed"]
        ).count()
    return figures["failed"], figures["succeeded"], since


def failing_subjects(window: timedelta, limit: int = 3) -> list[FailingSubject]:
    """Subjects whose jobs failed tries in the window, most failures first (at most
    ``limit`` + 1 are read: one is enough to know it is not one subject alone)."""
    since = clock.before(window.total_seconds())
    rows = (
        Attempt.objects.filter(finished_at__gte=since, outcome__in=TRIED)
        .values("job__subject_type", "job__subject_id")
        .annotate(
            failed=Count("id", filter=Q(outcome__in=FAILED_TRIES)),
            succeeded=Count("id", filter=Q(outcome=Attempt.Outcome.SUCCEEDED)),
            job_id=Max("job_id"),
        )
        .filter(failed__gt=0)
        .order_by("-failed", "job__subject_type", "job__subject_id")[: limit + 1]
    )
    return [
        FailingSubject(
            r["job__subject_type"], r["job__subject_id"], r["failed"], r["succeeded"], r["job_id"]
        )
        for r in rows
    ]


def stoppers() -> list[Stopper]:
    """Paused scopes and open circuits, with what waits behind each and since when."""
    found = []
    for rule in FlowRule.objects.filter(Q(paused=True) | ~Q(circuit_state=FlowRule.Circuit.CLOSED)):
        parts = rules.scope_provider(rule.scope)
        if parts is not None:
            provider, partition = parts
            held = Effect.objects.filter(
                provider=provider, state__in=[Effect.State.PENDING, Effect.State.UNKNOWN]
            )
            if partition:
                held = held.filter(job__tenant_key=partition)
        else:
            provider = ""
            held = Job.objects.filter(rules.to_q(rules.WAITING))
            if rule.scope.startswith(rules.FLOW_KIND_PREFIX):
                held = held.filter(kind=rule.scope.removeprefix(rules.FLOW_KIND_PREFIX))
            elif rule.scope.startswith(rules.FLOW_TENANT_PREFIX):
                held = held.filter(tenant_key=rule.scope.removeprefix(rules.FLOW_TENANT_PREFIX))
            else:  # queue:<name>
                held = held.filter(queue=rule.scope.partition(":")[2])
        figures = held.aggregate(n=Count("id"), oldest=Min("created_at"))
        if rule.paused:
            found.append(
                Stopper(
                    rule.scope, "paused", rule.updated_at, figures["n"], figures["oldest"], provider
                )
            )
        if provider and rule.circuit_state != FlowRule.Circuit.CLOSED:
            found.append(
                Stopper(
                    rule.scope,
                    "circuit",
                    rule.circuit_opened_at,
                    figures["n"],
                    figures["oldest"],
                    provider,
                )
            )
    return found


def queues() -> list[QueueView]:
    """Each queue with waiting jobs: depth, due, oldest due time, and whether a worker
    claimed a job of it in the last minute (the console's honest "a worker serves it":
    a claim is recorded, a cluster's listening is not)."""
    since = clock.before(WORKER_WINDOW.total_seconds())
    due = rules.to_q(rules.JOB_DUE)
    rows = (
        Job.objects.filter(rules.to_q(rules.WAITING))
        .values("queue")
        .annotate(
            waiting=Count("id"),
            due=Count("id", filter=due),
            oldest=Min("next_attempt_at", filter=due),
        )
        .order_by("queue")
    )
    # The last claim of each queue in the window: a queue's own says a worker serves it;
    # another's, made after this queue's oldest came due, says live workers pass it by.
    claimed = dict(
        Attempt.objects.filter(started_at__gte=since, number__gt=0)
        .values("job__queue")
        .annotate(last=Max("started_at"))
        .order_by()
        .values_list("job__queue", "last")
    )
    now = timezone.now()  # as the snapshot stamps its ages (snap.now)
    found = []
    for r in rows:
        oldest = r["oldest"]
        passed_by = oldest is not None and any(
            last > oldest + PASSED_BY_MARGIN for name, last in claimed.items() if name != r["queue"]
        )
        found.append(
            QueueView(
                r["queue"],
                r["waiting"],
                r["due"],
                oldest,
                r["queue"] in claimed,
                max(now - oldest, timedelta()) if oldest else None,
                passed_by=passed_by,
            )
        )
    return found


def retrying_on_the_same_error(limit: int = 10) -> list[tuple[Job, int]]:
    """Jobs still retrying whose tries failed with the same error at least twice: (job,
    how many tries had it). They are not dead yet, but the cause is the same each time."""
    jobs = (
        Job.objects.filter(state=Job.State.RETRY_WAIT)
        .exclude(last_error_code="")
        .annotate(
            same=Count(
                "attempt_set",
                filter=Q(
                    attempt_set__error_class=F("last_error_class"),
                    attempt_set__error_code=F("last_error_code"),
                ),
            )
        )
        .filter(same__gte=2)
        .order_by("-same", "id")[:limit]
    )
    return [(job, job.same) for job in jobs]
