"""``Q_CLUSTER`` from the app's own settings: one vocabulary in settings.py.

django-q2 reads ``Q_CLUSTER`` once, when ``django_q`` is first imported (before any
app's ``ready()``), so the app cannot fill it in later: settings.py calls
``jobs.q_cluster(...)`` instead::

    JOBS_LEASE_SECONDS = 60
    Q_CLUSTER = jobs.q_cluster(DATABASES, name="invoices", lease_seconds=JOBS_LEASE_SECONDS)

It derives what the engine's rules need (``timeout`` and ``retry`` above the lease, the
queue's table on the jobs' database, no result rows, no django-q2 retries of its own)
and the broker where the jobs table is the queue: ``jobs.claiming.ClaimingBroker`` on
PostgreSQL through psycopg 3 (LISTEN/NOTIFY, SKIP LOCKED), else
``jobs.claiming_orm.OrmClaimingBroker`` (the ORM, polling). Any key passed in
``overrides`` wins. ``manage.py check`` still judges the result (``jobs.E002``: lease <
timeout < retry).
"""

from __future__ import annotations

import os
from typing import Any

CLAIMING_BROKER = "jobs.claiming.ClaimingBroker"
ORM_CLAIMING_BROKER = "jobs.claiming_orm.OrmClaimingBroker"


def _psycopg3() -> bool:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return False
    return True


def q_cluster(
    databases: dict[str, dict[str, Any]],
    *,
    name: str = "jobs",
    database: str = "default",
    workers: int | None = None,
    lease_seconds: float = 60.0,
    **overrides: Any,
) -> dict[str, Any]:
    """django-q2's ``Q_CLUSTER`` for the jobs on ``databases[database]``.

    ``timeout`` is twice the lease and ``retry`` three times it (the order the checks
    hold), ``workers`` the machine's cores (at least 2). Plain django-q2 tasks keep
    working on the same cluster.
    """
    if database not in databases:
        raise ValueError(f"jobs.q_cluster: DATABASES has no {database!r} entry")
    if lease_seconds <= 0:
        raise ValueError(f"jobs.q_cluster: lease_seconds must be > 0, got {lease_seconds!r}")
    engine = str(databases[database].get("ENGINE", ""))
    on_postgres = engine.endswith("postgresql") and _psycopg3()
    cluster: dict[str, Any] = {
        "name": name,
        "orm": database,  # the queue's table beside the jobs: enqueue commits with the job
        "workers": workers or max(2, os.cpu_count() or 2),
        "timeout": int(2 * lease_seconds),
        "retry": int(3 * lease_seconds),
        "max_attempts": 0,  # the job's own attempt budget bounds work
        "save_limit": -1,  # attempts are the record: no django-q2 result rows
        "poll": 0.2,
        "catch_up": False,
        "ack_failures": False,
    }
    cluster["broker_class"] = CLAIMING_BROKER if on_postgres else ORM_CLAIMING_BROKER
    cluster.update(overrides)
    return cluster
