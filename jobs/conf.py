"""Engine settings, read at call time so tests and operators can change them."""

from __future__ import annotations

from django.conf import settings

DEFAULTS = {
    "JOBS_LEASE_SECONDS": 60.0,
    "JOBS_MAX_ATTEMPTS": 5,
    "JOBS_TENANT_CONCURRENCY": 4,
    "JOBS_BACKOFF_FLOOR_SECONDS": 1.0,
    "JOBS_BACKOFF_BASE_SECONDS": 2.0,
    "JOBS_BACKOFF_CAP_SECONDS": 300.0,
    "JOBS_EFFECT_LEASE_SECONDS": 30.0,
    "JOBS_EFFECT_MAX_ATTEMPTS": 8,
    "JOBS_TENANT_DEFER_SECONDS": 1.0,
    # How long a sender waits for one of a provider's in-flight slots before it
    # defers the effect (no attempt spent). Keep connect + read timeouts + this
    # below JOBS_EFFECT_LEASE_SECONDS (system check jobs.E010).
    "JOBS_PROVIDER_SLOT_WAIT_SECONDS": 2.0,
    # Extra delay (seconds, jittered up to twice this) before a deferred effect is due again.
    "JOBS_PROVIDER_DEFER_SECONDS": 0.5,
    "JOBS_ARTIFACT_STORAGE": "artifacts",
    # Worker transactions on PostgreSQL: the server ends one idle this long (None: a quarter
    # of the lease), and a worker's own CAS needs at least this much lease left, so a frozen
    # worker can never commit after its lease ran out. Lock waits end after the lock timeout
    # (None: half the lease).
    "JOBS_TRANSACTION_IDLE_SECONDS": None,
    "JOBS_LOCK_TIMEOUT_SECONDS": None,
    # A dependency outage (database, artifact storage) does not spend a job's attempts for
    # this long after it began; its retries back off up to the outage cap.
    "JOBS_OUTAGE_WINDOW_SECONDS": 3600.0,
    "JOBS_OUTAGE_BACKOFF_CAP_SECONDS": 60.0,
    # A still-due job whose message is older than this gets another (None: 2x Q retry).
    "JOBS_REDRIVE_AFTER_SECONDS": None,
    # What the connection sizing check (jobs.W010) counts against max_connections:
    # jobs_worker processes (each a qcluster) on all machines, dispatcher loops, and
    # connections the web servers hold (WSGI workers x threads, all machines).
    "JOBS_EXPECTED_WORKER_PROCESSES": 1,
    "JOBS_EXPECTED_DISPATCHERS": 1,
    "JOBS_EXPECTED_WEB_CONNECTIONS": 4,
}


def get(name: str):
    """Return the setting ``name`` or its documented default."""
    return getattr(settings, name, DEFAULTS[name])


def lease_seconds() -> float:
    return float(get("JOBS_LEASE_SECONDS"))


def max_attempts() -> int:
    return int(get("JOBS_MAX_ATTEMPTS"))


def tenant_concurrency() -> int:
    return int(get("JOBS_TENANT_CONCURRENCY"))


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


def redrive_after_seconds() -> float:
    configured = get("JOBS_REDRIVE_AFTER_SECONDS")
    if configured is not None:
        return float(configured)
    return 2 * float(getattr(settings, "Q_CLUSTER", {}).get("retry", 60))
