"""Start-up checks: lease < Q_CLUSTER timeout < retry, the artifact storage exists, and
PostgreSQL allows the connections the configured processes need."""

from __future__ import annotations

import os
from dataclasses import dataclass

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register
from django.db import DatabaseError, connections

from jobs import conf


@register()
def check_timing(app_configs=None, **kwargs):
    errors = []
    q = getattr(settings, "Q_CLUSTER", {})
    lease = conf.lease_seconds()
    timeout, retry = q.get("timeout"), q.get("retry", 60)
    if timeout is None:
        errors.append(Error("Q_CLUSTER['timeout'] must be set", id="jobs.E001"))
    elif not (lease < timeout < retry):
        errors.append(
            Error(
                f"JOBS_LEASE_SECONDS ({lease}) < Q_CLUSTER['timeout'] ({timeout}) < "
                f"Q_CLUSTER['retry'] ({retry}) must hold",
                hint="django-q2 redelivers after 'retry'; a worker must lose its lease first.",
                id="jobs.E002",
            )
        )
    if q.get("orm") is None:
        errors.append(
            Warning(
                "Q_CLUSTER does not use the ORM broker: enqueue is not atomic with the job row",
                hint="The dispatcher still re-drives due jobs, but a crash between commit and "
                "enqueue delays a job until it is found.",
                id="jobs.W001",
            )
        )
    return errors


@register()
def check_storage(app_configs=None, **kwargs):
    alias = conf.get("JOBS_ARTIFACT_STORAGE")
    if alias not in getattr(settings, "STORAGES", {}):
        return [Error(f"STORAGES has no {alias!r} entry (JOBS_ARTIFACT_STORAGE)", id="jobs.E003")]
    return []


# Per qcluster, besides its workers: the sentinel (it runs the scheduler), the pusher
# and the monitor each hold a connection; the jobs_worker supervisor holds one more.
CLUSTER_CONNECTIONS = 3
SUPERVISOR_CONNECTIONS = 1


@dataclass(frozen=True)
class ConnectionNeed:
    """How many connections the configured processes may hold at once, and why."""

    worker_processes: int
    q_workers: int
    dispatchers: int
    web: int

    @property
    def per_worker_process(self) -> int:
        return self.q_workers + CLUSTER_CONNECTIONS + SUPERVISOR_CONNECTIONS

    @property
    def total(self) -> int:
        return self.worker_processes * self.per_worker_process + self.dispatchers + self.web

    def explain(self) -> str:
        return (
            f"{self.worker_processes} worker process(es) x ({self.q_workers} django-q2 "
            f"workers + {CLUSTER_CONNECTIONS} cluster processes + {SUPERVISOR_CONNECTIONS} "
            f"supervisor) + {self.dispatchers} dispatcher(s) + {self.web} web"
        )


def connection_need() -> ConnectionNeed:
    """What JOBS_EXPECTED_* and Q_CLUSTER['workers'] add up to."""
    q = getattr(settings, "Q_CLUSTER", {})
    return ConnectionNeed(
        worker_processes=int(conf.get("JOBS_EXPECTED_WORKER_PROCESSES")),
        q_workers=int(q.get("workers") or os.cpu_count() or 1),
        dispatchers=int(conf.get("JOBS_EXPECTED_DISPATCHERS")),
        web=int(conf.get("JOBS_EXPECTED_WEB_CONNECTIONS")),
    )


@register(Tags.database)
def check_connections(app_configs=None, databases=None, **kwargs):
    """Warn when PostgreSQL allows fewer connections than the configured processes need.

    Runs with the database checks (``migrate``, ``check --database default``, and
    ``jobs_worker`` once the database answers); silent when the database is not
    PostgreSQL or cannot be reached. A refused connection fails a delivery before
    its claim, and django-q2 hands the message out again only after its retry.
    """
    alias = getattr(settings, "Q_CLUSTER", {}).get("orm") or "default"
    if not databases or alias not in databases:
        return []
    conn = connections[alias]
    if conn.vendor != "postgresql":
        return []
    try:
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('max_connections')::int,"
                " current_setting('superuser_reserved_connections')::int,"
                " coalesce(current_setting('reserved_connections', true), '0')::int"
            )
            max_connections, superuser_reserved, reserved = cursor.fetchone()
    except DatabaseError:
        return []
    allowed = max_connections - superuser_reserved - reserved
    need = connection_need()
    if need.total <= allowed:
        return []
    return [
        Warning(
            f"PostgreSQL allows {allowed} connections (max_connections {max_connections} "
            f"- {superuser_reserved + reserved} reserved) but the configured processes may "
            f"hold {need.total} ({need.explain()}): {need.total - allowed} missing",
            hint="Raise max_connections, lower Q_CLUSTER['workers'] or the "
            "JOBS_EXPECTED_* settings, or put a session pooler in front of PostgreSQL. "
            "Other databases on the same server share the limit.",
            id="jobs.W010",
        )
    ]
