"""Every setting of the app, its default and what it is for: the one place they live.

Read at call time (``conf.get(name)``), never at import, so tests and operators
can change them. ``docs/app/settings.md`` lists the same table; a test keeps the
two in step and checks that no other module reads these settings directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    doc: str
    zero_turns_off: bool = False  # 0 is a meaning, not a typo (jobs.E004 lets it through)


SETTINGS: tuple[Setting, ...] = (
    # --- jobs ---------------------------------------------------------------------
    Setting(
        "JOBS_LEASE_SECONDS",
        60.0,
        "How long a claim holds a job without a heartbeat. Must be below "
        "Q_CLUSTER['timeout'], which must be below Q_CLUSTER['retry'] (check jobs.E002).",
    ),
    Setting("JOBS_MAX_ATTEMPTS", 5, "Attempt budget of a job whose kind sets none."),
    Setting(
        "JOBS_PRIORITY_AGING_SECONDS",
        60.0,
        "Waiting that raises a job's effective priority by one level (the claim's "
        "anti-starvation aging, docs/app/scheduling.md).",
    ),
    Setting(
        "JOBS_SCHEDULES",
        {},
        "Periodic kinds declared elsewhere: kind name -> {'cron' or 'every' (seconds), 'tz', "
        "'catch_up': 'latest'|'all'}; wins over the kind's own schedule= "
        "(docs/app/schedules.md, check jobs.E040).",
    ),
    Setting(
        "JOBS_CONSOLE_WINDOW_SECONDS",
        300.0,
        "The window of the console's verdict: failed tries are judged over it; 'Recovering' "
        "once a try succeeds after the last failure, 'Healthy' when the window has passed it.",
    ),
    Setting(
        "JOBS_TIMEOUT_GRACE_SECONDS",
        5.0,
        "How long a handler past its kind's timeout has to reach its next check or return "
        "before the worker stops the attempt; a kind's timeout plus this must stay below "
        "Q_CLUSTER['timeout'] (check jobs.E007).",
    ),
    Setting(
        "JOBS_FOLLOW_ON_SECONDS",
        1.0,
        "How long a worker that finished a job keeps claiming its queues' next due work "
        "itself, without a round through django-q2's pusher, task queue and monitor "
        "(docs/broker.md); 0 turns it off. Cut so that the longest kind "
        "timeout plus JOBS_TIMEOUT_GRACE_SECONDS still ends before Q_CLUSTER['timeout'].",
        zero_turns_off=True,
    ),
    Setting("JOBS_TENANT_CONCURRENCY", 4, "Most jobs of one tenant running at once."),
    Setting(
        "JOBS_FAIR_SHARE",
        True,
        "True: the next-job claim shares each priority band among a queue's tenants by "
        "weight (start-time fair queueing, docs/app/fairness.md) while two or more wait; "
        "with fewer it takes the plain order at the cost of two index probes. False: the "
        "plain order (priority, then due time) always.",
    ),
    Setting(
        "JOBS_TENANT_WEIGHT",
        1,
        "A tenant's weight in the fair share where neither its rule nor tenant:* sets one.",
    ),
    Setting(
        "JOBS_TENANT_DEFER_SECONDS",
        1.0,
        "Delay (jittered up to twice) before a job held back by its tenant's bound is due again.",
    ),
    Setting("JOBS_BACKOFF_FLOOR_SECONDS", 1.0, "Smallest retry delay (never an instant retry)."),
    Setting("JOBS_BACKOFF_BASE_SECONDS", 2.0, "Retry n waits floor + up to base * 2^(n-1)."),
    Setting("JOBS_BACKOFF_CAP_SECONDS", 300.0, "Largest retry delay."),
    Setting(
        "JOBS_ARTIFACT_STORAGE",
        "artifacts",
        "The STORAGES alias artifacts are written to (check jobs.E003).",
    ),
    Setting(
        "JOBS_ARTIFACT_REPLICA_STORAGE",
        None,
        "A second STORAGES alias every artifact is also written to (exclusively); a restore "
        "copies the published bytes back from it (None: no replica, restores re-run the "
        "producer and accept only the published sha256).",
    ),
    Setting(
        "JOBS_RETENTION_DAYS",
        None,
        "jobs_worker's maintenance round deletes the attempts and final effects of jobs "
        "finished more than this many days ago, at most once an hour (None: never; "
        "manage.py jobs_prune --older-than does it on demand; at least JOBS_PRUNE_MIN_DAYS, "
        "check jobs.E041). Orphan files stay for jobs_prune: jobs_reconcile reads them first.",
    ),
    Setting(
        "JOBS_ARCHIVE_AFTER_DAYS",
        None,
        "jobs_worker's maintenance round archives jobs finished more than this many days "
        "ago whose effects are all settled: their rows go, a compact identity record stays, "
        "so asking for them again returns the same job (None: never; manage.py jobs_prune "
        "--archive does it on demand; at least JOBS_PRUNE_MIN_DAYS, check jobs.E042).",
    ),
    Setting(
        "JOBS_ORPHAN_GRACE_SECONDS",
        3600.0,
        "manage.py jobs_prune deletes artifact files named by no row only once they are "
        "this old (a file of a job still running may be about to be published).",
    ),
    Setting(
        "JOBS_RESTORE_STALE_SECONDS",
        300.0,
        "A restore requested this long ago and not finished no longer holds back another "
        "request (at least Q_CLUSTER['retry'], so a redelivered restore is not doubled).",
    ),
    Setting(
        "JOBS_TRANSACTION_IDLE_SECONDS",
        None,
        "PostgreSQL: the server ends a worker transaction idle this long, and a worker's own "
        "CAS needs this much lease left, so a frozen worker never commits late "
        "(None: a quarter of the lease).",
    ),
    Setting(
        "JOBS_LOCK_TIMEOUT_SECONDS",
        None,
        "PostgreSQL: a worker's lock waits end after this (None: half the lease).",
    ),
    Setting(
        "JOBS_PREPARED_STATEMENTS",
        True,
        "PostgreSQL: the claim, ownership check and publish run as prepared statements "
        "(planned once per connection). False behind a pooler that loses them "
        "(PgBouncer in transaction mode before 1.21).",
    ),
    Setting(
        "JOBS_REQUIRE_SYNC_REPLICATION",
        False,
        "PostgreSQL: this deployment promises that a failover loses no acknowledged job; "
        "check jobs.W020 warns when the primary reports no synchronous standby "
        "(docs/deployment.md).",
    ),
    Setting(
        "JOBS_OUTAGE_WINDOW_SECONDS",
        3600.0,
        "A dependency outage (database, artifact storage) does not spend a job's attempts "
        "for this long after it began.",
    ),
    Setting(
        "JOBS_OUTAGE_BACKOFF_CAP_SECONDS",
        60.0,
        "Largest retry delay while a dependency is down.",
    ),
    Setting(
        "JOBS_PRUNE_MIN_DAYS",
        7,
        "manage.py jobs_prune keeps finished jobs at least this many days.",
    ),
    # --- effects ------------------------------------------------------------------
    Setting(
        "JOBS_EFFECT_LEASE_SECONDS",
        30.0,
        "How long one sender holds an effect; a send (timeouts + slot wait) must end "
        "within it (checks jobs.E010, jobs.W012).",
    ),
    Setting(
        "JOBS_EFFECT_MAX_ATTEMPTS",
        8,
        "Send budget of an effect (enforced at its claim); spent: needs_review or failed.",
    ),
    Setting(
        "JOBS_REDRIVE_MAX",
        500,
        "Most rows one redrive (console or manage.py jobs_redrive) takes; the rest of a "
        "group waits for the next one (docs/operations.md, Redrive).",
    ),
    Setting(
        "JOBS_TELEMETRY",
        True,
        "OpenTelemetry spans and instruments when opentelemetry-api is installed and a "
        "tracer or meter provider is configured (docs/app/observability.md); False: never.",
    ),
    Setting(
        "JOBS_PROVIDER_SLOT_WAIT_SECONDS",
        2.0,
        "How long a sender waits for one of a provider's in-flight slots before the "
        "effect is deferred (no attempt spent).",
    ),
    Setting(
        "JOBS_PROVIDER_DEFER_SECONDS",
        0.5,
        "Delay (jittered up to twice) before a deferred effect is due again.",
    ),
    Setting(
        "JOBS_PROVIDER_SLOT_DIR",
        None,
        "SQLite only: folder of the in-flight slot lock files (None: next to the database).",
    ),
    # --- flow control -------------------------------------------------------------
    Setting(
        "JOBS_FLOW_CACHE_SECONDS",
        1.0,
        "How long a process keeps the flow rules it read (jobs.models.FlowRule) before it "
        "reads them again; a change takes effect within this plus one defer.",
    ),
    Setting(
        "JOBS_FLOW_PAUSED_DEFER_SECONDS",
        0.5,
        "Delay (jittered up to twice) before work held back by a paused scope is due again.",
    ),
    Setting(
        "JOBS_CIRCUIT_FAILURES",
        5,
        "Consecutive failed calls to a provider (transport, temporary, provider timeout) "
        "that open its circuit: its effects then wait without spending attempts.",
    ),
    Setting(
        "JOBS_CIRCUIT_PROBE_SECONDS",
        1.0,
        "First interval between two probe calls of an open circuit (doubles per failed probe).",
    ),
    Setting(
        "JOBS_CIRCUIT_PROBE_CAP_SECONDS",
        30.0,
        "Longest interval between two probe calls of an open circuit.",
    ),
    # --- providers ----------------------------------------------------------------
    Setting(
        "NOTICE_PROVIDER_URL",
        "",
        "Base URL of the HTTP notice provider (POST {url}/notices); empty: the webhook "
        "provider has nowhere to send and such effects go to needs_review.",
    ),
    Setting("NOTICE_PROVIDER_TOKEN", "", "Bearer token sent to the HTTP notice provider."),
    Setting("NOTICE_PROVIDER_CONNECT_TIMEOUT", 3.0, "Seconds to connect to the provider."),
    Setting("NOTICE_PROVIDER_READ_TIMEOUT", 10.0, "Seconds to wait for the provider's answer."),
    Setting("NOTICE_PROVIDER_MAX_IN_FLIGHT", 4, "Most webhook calls in flight (0: unbounded)."),
    Setting(
        "NOTICE_PROVIDER_LOOKUP",
        True,
        "Ask the provider what became of a key (GET {url}/notices/{key}) before sending "
        "again an effect whose outcome is unknown; off: resend under the same key.",
    ),
    Setting("NOTICE_EMAIL_MAX_IN_FLIGHT", 2, "Most e-mail sends in flight (0: unbounded)."),
    Setting(
        "NOTICE_EMAIL_TIMEOUT",
        10.0,
        "Seconds per SMTP step when Django's EMAIL_TIMEOUT is not set.",
    ),
    # --- operations ---------------------------------------------------------------
    Setting(
        "JOBS_HOST_NAME",
        "",
        "The host part of worker identities (host:pid:nonce) and of probe names "
        "(empty: socket.gethostname()). Set it when several hosts share a name, or to "
        "tell apart several simulated hosts on one machine.",
    ),
    Setting(
        "JOBS_EXPECTED_WORKER_PROCESSES",
        1,
        "Connection sizing check (jobs.W010): jobs_worker processes (each a qcluster) on "
        "all machines.",
    ),
    Setting("JOBS_EXPECTED_DISPATCHERS", 1, "Connection sizing check: dispatcher loops."),
    Setting(
        "JOBS_EXPECTED_WEB_CONNECTIONS",
        4,
        "Connection sizing check: connections the web servers hold (WSGI workers x threads, "
        "all machines).",
    ),
    Setting(
        "METRICS_TOKEN",
        "",
        "Bearer token that may read /metrics without a session (empty: sessions only).",
    ),
)

DEFAULTS: dict[str, Any] = {s.name: s.default for s in SETTINGS}


_UNSET = object()


def get(name: str, default: Any = _UNSET) -> Any:
    """Return the setting ``name`` or its documented default (KeyError for unknown names).

    ``default`` is for names outside the table that share a documented one (a
    second webhook provider's ``<PREFIX>_READ_TIMEOUT``).
    """
    if name in DEFAULTS:
        return getattr(settings, name, DEFAULTS[name])
    if default is _UNSET:
        raise KeyError(f"{name} is not a setting of the jobs app (jobs.conf.SETTINGS)")
    return getattr(settings, name, default)


def host_name() -> str:
    """This host's name in worker identities: JOBS_HOST_NAME, else the system's."""
    import socket

    return str(get("JOBS_HOST_NAME") or socket.gethostname())


def lease_seconds() -> float:
    return float(get("JOBS_LEASE_SECONDS"))


def max_attempts() -> int:
    return int(get("JOBS_MAX_ATTEMPTS"))


def timeout_grace_seconds() -> float:
    return float(get("JOBS_TIMEOUT_GRACE_SECONDS"))


def follow_on_seconds() -> float:
    return max(0.0, float(get("JOBS_FOLLOW_ON_SECONDS")))


def tenant_concurrency() -> int:
    return int(get("JOBS_TENANT_CONCURRENCY"))


def fair_share() -> bool:
    return bool(get("JOBS_FAIR_SHARE"))


def tenant_weight() -> int:
    return max(1, int(get("JOBS_TENANT_WEIGHT")))


def effect_max_attempts() -> int:
    """The send budget of a new effect (an operator's "send again" grants another)."""
    return int(get("JOBS_EFFECT_MAX_ATTEMPTS"))


def backoff(attempt: int, *, retry_after: float | None = None) -> float:
    """The retry table's backoff with this site's floor, base and cap."""
    from jobs.retry import backoff_delay

    return backoff_delay(
        attempt,
        floor=float(get("JOBS_BACKOFF_FLOOR_SECONDS")),
        base=float(get("JOBS_BACKOFF_BASE_SECONDS")),
        cap=float(get("JOBS_BACKOFF_CAP_SECONDS")),
        retry_after=retry_after,
    )


def transaction_idle_seconds() -> float:
    value = get("JOBS_TRANSACTION_IDLE_SECONDS")
    return lease_seconds() / 4 if value is None else float(value)


def prepared_statements() -> bool:
    return bool(get("JOBS_PREPARED_STATEMENTS"))


def lock_timeout_seconds() -> float:
    value = get("JOBS_LOCK_TIMEOUT_SECONDS")
    return lease_seconds() / 2 if value is None else float(value)


def outage_window_seconds() -> float:
    return float(get("JOBS_OUTAGE_WINDOW_SECONDS"))


def outage_backoff(attempt: int) -> float:
    """Backoff while a dependency is down: same floor and base, the longer outage cap."""
    from jobs.retry import backoff_delay

    return backoff_delay(
        attempt,
        floor=float(get("JOBS_BACKOFF_FLOOR_SECONDS")),
        base=float(get("JOBS_BACKOFF_BASE_SECONDS")),
        cap=float(get("JOBS_OUTAGE_BACKOFF_CAP_SECONDS")),
    )


def q_cluster() -> dict:
    """django-q2's ``Q_CLUSTER`` (the app reads its timeout, retry and broker)."""
    return getattr(settings, "Q_CLUSTER", None) or {}


def orphan_grace_seconds() -> float:
    return float(get("JOBS_ORPHAN_GRACE_SECONDS"))


def restore_stale_seconds() -> float:
    """How old an unfinished restore request is before another may be queued."""
    return max(float(get("JOBS_RESTORE_STALE_SECONDS")), float(q_cluster().get("retry", 60)))
