"""Start-up checks: each names the setting or app that is missing or out of order.

``manage.py check`` (and every command that runs checks: migrate, qcluster,
runserver) stops on an Error, so a project learns what to fix before a job runs.

| id | what |
|---|---|
| jobs.E001, E002 | ``Q_CLUSTER['timeout']`` set; lease < timeout < retry |
| jobs.E003 | the artifact storage alias exists in ``STORAGES`` |
| jobs.E031 | an object-store artifact storage refuses a second conditional create |
| jobs.W017 | an object-store artifact storage did not answer at start-up (an outage: jobs wait) |
| jobs.E004 | a jobs setting has a value of the wrong type or sign |
| jobs.E020 | ``django_q`` is in ``INSTALLED_APPS`` |
| jobs.E021, E022 | the queue's broker keeps its messages in the database the jobs are written to |
| jobs.E023 | ``jobs.broker.PostgresBroker`` runs on PostgreSQL |
| jobs.W019 | the PostgreSQL broker's LISTEN does not go through a pooler (database tag) |
| jobs.E010 (webhook.py), E011, E012, W011 | the webhook provider: timing, httpx, URL, token |
| jobs.W012 | an e-mail send fits inside the sending lease |
| jobs.W013 | one send fits inside ``Q_CLUSTER['timeout']`` (a release task makes one) |
| jobs.E005 | the publish margin (``JOBS_TRANSACTION_IDLE_SECONDS``) is at most ⅔ of the lease |
| jobs.E006 | ``JOBS_LOCK_TIMEOUT_SECONDS`` is below the lease |
| jobs.E007 | a kind's ``timeout`` is below ``Q_CLUSTER['timeout']`` |
| jobs.W018 | a kind's ``timeout`` beyond the lease: its handler must heartbeat |
| jobs.W010 | PostgreSQL allows the connections the configured processes need (database tag) |
| jobs.W014 | no pooler in front of PostgreSQL while prepared statements are on (database tag) |
| jobs.W020 | ``JOBS_REQUIRE_SYNC_REPLICATION``: the primary has a sync standby (database tag) |
| jobs.I001 | which path the hot path takes on this database, and why (database tag) |
| jobs.W015 | the jobs' SQLite database runs without ``transaction_mode="IMMEDIATE"`` and WAL |
| jobs.W016 | the metrics URL is routed but ``prometheus_client`` (``[metrics]``) is missing |
| jobs.E040 | every schedule (``jobs.kind(schedule=)``, ``JOBS_SCHEDULES``) can be read |
| jobs.E041 | ``JOBS_RETENTION_DAYS`` is outside the redelivery safety window |
| jobs.E042 | ``JOBS_ARCHIVE_AFTER_DAYS`` is outside the redelivery safety window |
| jobs.W021 | ``JOBS_RETENTION_DAYS`` is at least ``JOBS_ARCHIVE_AFTER_DAYS`` (when both are set) |

Checks of one part live in that part's module (the storage's in ``jobs.artifacts``, the
broker's in ``jobs.queue``, the e-mail provider's in ``jobs.providers.email``, the
webhook's timing in ``jobs.providers.webhook``, the executor's in ``jobs.executors``) and
are registered at the end of this module; the rest read several parts at once. The
documentation site renders every check from the source (``docs/app/checks.md``).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.apps import apps
from django.conf import settings
from django.core.checks import Error, Tags, Warning, register
from django.db import DatabaseError, connections, router
from django.db.backends.base.base import BaseDatabaseWrapper

from jobs import archive, artifacts, conf, executors, queue, registry, retention, schedules
from jobs.providers import email


@register()
def check_timing(app_configs=None, **kwargs):
    errors = []
    q = conf.q_cluster()
    lease = conf.lease_seconds()
    timeout, retry = q.get("timeout"), q.get("retry", 60)
    if timeout is None:
        errors.append(
            Error(
                "Q_CLUSTER['timeout'] must be set",
                hint="e.g. Q_CLUSTER = {'orm': 'default', 'timeout': 120, 'retry': 180}",
                id="jobs.E001",
            )
        )
    elif not (lease < timeout < retry):
        errors.append(
            Error(
                f"JOBS_LEASE_SECONDS ({lease}) < Q_CLUSTER['timeout'] ({timeout}) < "
                f"Q_CLUSTER['retry'] ({retry}) must hold",
                hint="django-q2 redelivers after 'retry'; a worker must lose its lease first.",
                id="jobs.E002",
            )
        )
    return errors


@register()
def check_setting_values(app_configs=None, **kwargs):
    """Numbers are numbers and positive: a typo fails here, not in a worker at 3 a.m."""
    errors = []
    for s in conf.SETTINGS:
        if isinstance(s.default, bool):  # a switch (bool is an int to isinstance)
            continue
        if not isinstance(s.default, (int, float)) and not (
            s.default is None and s.name.endswith("_SECONDS")
        ):
            continue
        value = conf.get(s.name)
        if value is None and s.default is None:
            continue
        try:
            zero_ok = s.name.endswith("IN_FLIGHT") or s.zero_turns_off
            ok = float(value) >= 0 and (float(value) > 0 or zero_ok)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            what = "a number >= 0 (0 turns it off)" if s.zero_turns_off else "a positive number"
            errors.append(Error(f"{s.name} must be {what}, got {value!r}", id="jobs.E004"))
    return errors


@register()
def check_webhook(app_configs=None, **kwargs):
    """When NOTICE_PROVIDER_URL is set: httpx installed, an http(s) URL, a token."""
    url = conf.get("NOTICE_PROVIDER_URL")
    if not url:
        return []
    if importlib.util.find_spec("httpx") is None:
        return [
            Error(
                "NOTICE_PROVIDER_URL is set but httpx is not installed",
                hint="pip install 'django-jobs-ledger[webhook]'",
                id="jobs.E011",
            )
        ]
    parts = urlsplit(str(url))
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return [
            Error(
                f"NOTICE_PROVIDER_URL must be an http(s) URL with a host, got {url!r}",
                id="jobs.E012",
            )
        ]
    if not conf.get("NOTICE_PROVIDER_TOKEN"):
        return [
            Warning(
                "NOTICE_PROVIDER_URL is set without NOTICE_PROVIDER_TOKEN",
                hint="The provider is called without an Authorization header.",
                id="jobs.W011",
            )
        ]
    return []


def _send_budgets() -> dict[str, float]:
    """Seconds one send may take, per provider in use: its timeouts plus the slot wait."""
    wait = float(conf.get("JOBS_PROVIDER_SLOT_WAIT_SECONDS"))
    budgets = {"email": email.send_timeout() + wait}
    if conf.get("NOTICE_PROVIDER_URL"):
        budgets["webhook"] = (
            float(conf.get("NOTICE_PROVIDER_CONNECT_TIMEOUT"))
            + float(conf.get("NOTICE_PROVIDER_READ_TIMEOUT"))
            + wait
        )
    return budgets


@register()
def check_inline_release(app_configs=None, **kwargs):
    """Each external send runs in its own task (``jobs.tasks.release_claimed``): one send
    must end before django-q2 stops that task."""
    timeout = conf.q_cluster().get("timeout")
    if timeout is None:
        return []
    provider, budget = max(_send_budgets().items(), key=lambda item: item[1])
    if budget >= float(timeout):
        return [
            Warning(
                f"one {provider} send ({budget:g}) is not below Q_CLUSTER['timeout'] ({timeout})",
                hint="django-q2 may stop the release task mid-send; the effect is claimed "
                "again when its sending lease runs out, but the notice is late.",
                id="jobs.W013",
            )
        ]
    return []


@register()
def check_fences(app_configs=None, **kwargs):
    """The publish margin and the lock timeout must leave the lease room to work.

    A worker extends its lease only once it is a third spent (``JobContext.heartbeat``),
    so a publish may start with only ⅔ of it left; a margin above that makes such a
    job lose its own publish every time. A lock wait as long as the lease outlives it.
    """
    lease = conf.lease_seconds()
    errors = []
    margin = conf.transaction_idle_seconds()
    if margin > lease * 2 / 3:
        errors.append(
            Error(
                f"JOBS_TRANSACTION_IDLE_SECONDS ({margin:g}) is above ⅔ of "
                f"JOBS_LEASE_SECONDS ({lease:g})",
                hint="The publish needs that much lease left; a job that finishes before its "
                "first heartbeat would lose its own publish every time.",
                id="jobs.E005",
            )
        )
    lock = conf.lock_timeout_seconds()
    if lock >= lease:
        errors.append(
            Error(
                f"JOBS_LOCK_TIMEOUT_SECONDS ({lock:g}) is not below JOBS_LEASE_SECONDS ({lease:g})",
                hint="A worker waiting that long for a lock would outlive its lease.",
                id="jobs.E006",
            )
        )
    return errors


@register()
def check_kind_timeouts(app_configs=None, **kwargs):
    """A kind's timeout must end before django-q2's, and past the lease it needs heartbeats.

    django-q2 kills a worker whose task outlives ``Q_CLUSTER['timeout']``, so a kind's
    timeout at or above it would never be what stops an attempt (the worker's hard stop
    comes ``JOBS_TIMEOUT_GRACE_SECONDS`` later, cut short to end before django-q2's
    alarm). A timeout beyond the lease is allowed: a handler that calls
    ``ctx.heartbeat()`` or ``ctx.progress()`` keeps its lease; one that does not is
    reclaimed by another worker while it still runs, and its publish is refused.
    """
    q_timeout = conf.q_cluster().get("timeout")
    lease = conf.lease_seconds()
    messages = []
    for name, kind in sorted(registry.kinds().items()):
        if kind.timeout is None:
            continue
        if q_timeout is not None and kind.timeout >= float(q_timeout):
            messages.append(
                Error(
                    f"job kind {name!r}: timeout ({kind.timeout:g} s) is not below "
                    f"Q_CLUSTER['timeout'] ({float(q_timeout):g} s)",
                    hint="django-q2 kills the worker at Q_CLUSTER['timeout']: lower the "
                    "kind's timeout, or raise Q_CLUSTER['timeout'] (and 'retry' above it).",
                    id="jobs.E007",
                )
            )
        elif kind.timeout > lease:
            messages.append(
                Warning(
                    f"job kind {name!r}: timeout ({kind.timeout:g} s) is beyond "
                    f"JOBS_LEASE_SECONDS ({lease:g} s)",
                    hint="Its handler must call ctx.heartbeat() or ctx.progress() more often "
                    "than the lease, or another worker reclaims the job while it runs.",
                    id="jobs.W018",
                )
            )
    return messages


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


def _pooler_ports(databases) -> tuple[int, int] | None:
    """(client port, server port) when a pooler or relay sits in front of PostgreSQL.

    Seen from here as a port the server does not listen on: the client connects to
    ``PORT`` (PgBouncer's 6432, say) and ``inet_server_port()`` names another. None on
    other databases, over a Unix socket, when they agree or the server cannot be asked.
    """
    alias = getattr(settings, "Q_CLUSTER", {}).get("orm") or "default"
    if not databases or alias not in databases:
        return None
    conn = connections[alias]
    if conn.vendor != "postgresql":
        return None
    try:
        client_port = int(conn.settings_dict.get("PORT") or 5432)
        with conn.cursor() as cursor:
            cursor.execute("SELECT inet_server_port()")
            (server_port,) = cursor.fetchone()
    except (DatabaseError, ValueError):
        return None
    if server_port is None or int(server_port) == client_port:
        return None
    return client_port, int(server_port)


@register(Tags.database)
def check_pooler(app_configs=None, databases=None, **kwargs):
    """Warn when a pooler or relay sits in front of PostgreSQL and prepared statements are on.

    PgBouncer in transaction mode before 1.21 loses prepared statements between
    transactions (docs/deployment.md); silent when they are off.
    """
    if not conf.prepared_statements():
        return []
    ports = _pooler_ports(databases)
    if ports is None:
        return []
    return [
        Warning(
            f"this process connects to port {ports[0]} but PostgreSQL listens on "
            f"{ports[1]}: a pooler or relay is in between, and JOBS_PREPARED_STATEMENTS "
            "is on",
            hint="Behind PgBouncer in transaction mode before 1.21 set "
            "JOBS_PREPARED_STATEMENTS=False; from 1.21 set max_prepared_statements (e.g. 200). "
            "Workers need a session-mode pool (provider slots are session advisory locks). "
            "See docs/deployment.md.",
            id="jobs.W014",
        )
    ]


@register(Tags.database)
def check_broker_pooler(app_configs=None, databases=None, **kwargs):
    """Warn when the PostgreSQL broker's LISTEN goes through a pooler.

    In transaction mode a pooler hands the LISTEN's server session to others, so the
    broker hears nobody's NOTIFY and polls every ``poll`` (it says so in its log and
    tries again each minute): nothing is lost, the wake-on-commit is. A session pool
    works. Silent with the ORM broker or with ``broker_listen`` off.
    """
    cluster = conf.q_cluster()
    if cluster.get("broker_class") != queue.CLAIMING_BROKER:
        return []
    if not cluster.get("broker_listen", True):
        return []
    ports = _pooler_ports(databases)
    if ports is None:
        return []
    return [
        Warning(
            f"the PostgreSQL broker listens through port {ports[0]} but PostgreSQL listens "
            f"on {ports[1]}: behind a pooler in transaction mode LISTEN hears nobody and "
            f"the workers poll every Q_CLUSTER['poll'] ({cluster.get('poll', 0.2)} s)",
            hint="Give the workers a session-mode pool or a direct connection, or set "
            "Q_CLUSTER['broker_listen'] = False to poll without trying. See docs/broker.md.",
            id="jobs.W019",
        )
    ]


# synchronous_commit values with which a commit waits for the synchronous standby.
COMMIT_WAITS_FOR_STANDBY = ("on", "remote_write", "remote_apply")


@dataclass(frozen=True)
class Replication:
    """What a PostgreSQL server says about its synchronous standbys."""

    standby_names: str  # synchronous_standby_names: empty means none is synchronous
    synchronous_commit: str
    in_recovery: bool  # this connection reached a standby, not the primary
    sync_standbys: int | None  # connected as sync or quorum; None when hidden from this role

    def problem(self) -> str | None:
        """Why a failover could lose an acknowledged commit, or None."""
        if self.in_recovery:
            return (
                "this connection reaches a standby (in recovery), not the primary: "
                "nothing can be written here"
            )
        if not self.standby_names.strip():
            return (
                "the primary has no synchronous standby (synchronous_standby_names is "
                "empty): a failover to an asynchronous standby loses what it had not yet "
                "received, acknowledged jobs included"
            )
        if self.synchronous_commit not in COMMIT_WAITS_FOR_STANDBY:
            return (
                f"synchronous_commit is {self.synchronous_commit!r}: commits do not wait "
                "for the synchronous standby"
            )
        if self.sync_standbys == 0:
            return (
                f"synchronous_standby_names is {self.standby_names!r} but no standby is "
                "connected as sync or quorum (pg_stat_replication): commits wait until one is"
            )
        return None


def replication(conn: BaseDatabaseWrapper) -> Replication:
    """Ask ``conn``'s PostgreSQL server about its synchronous standbys."""
    with conn.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('synchronous_standby_names'),"
            " current_setting('synchronous_commit'), pg_is_in_recovery(),"
            " (SELECT count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')) FROM"
            " pg_stat_replication),"
            " (SELECT count(*) FILTER (WHERE sync_state IS NULL) FROM pg_stat_replication)"
        )
        names, commit, in_recovery, sync, hidden = cursor.fetchone()
    # A role without pg_read_all_stats sees the rows but not their sync_state.
    return Replication(names, commit, in_recovery, None if not sync and hidden else int(sync))


@register(Tags.database)
def check_sync_replication(app_configs=None, databases=None, **kwargs):
    """Warn when ``JOBS_REQUIRE_SYNC_REPLICATION`` is on and the jobs' database reports no
    synchronous standby.

    With asynchronous replication a promoted standby lacks the primary's last commits:
    jobs whose publish was acknowledged (and whose notices a provider may have
    accepted) are gone. Synchronous replication (``synchronous_commit`` on or
    ``remote_apply`` and a named standby) loses none (docs/deployment.md). Runs with the
    database checks; silent when the setting is off or the database cannot be asked.
    """
    if not conf.get("JOBS_REQUIRE_SYNC_REPLICATION"):
        return []
    alias = router.db_for_write(apps.get_model("jobs", "Job"))
    if not databases or alias not in databases:
        return []
    conn = connections[alias]
    if conn.vendor != "postgresql":
        problem = f"the jobs' database {alias!r} is {conn.vendor}, which has no standby"
    else:
        try:
            problem = replication(conn).problem()
        except DatabaseError:
            return []
    if problem is None:
        return []
    return [
        Warning(
            f"JOBS_REQUIRE_SYNC_REPLICATION is on but {problem}",
            hint="Name a standby in synchronous_standby_names (e.g. 'FIRST 1 (standby1)') and "
            "keep synchronous_commit = on or remote_apply on the primary; connect with "
            "target_session_attrs=read-write. See docs/deployment.md, 'Replication and "
            "failover'.",
            id="jobs.W020",
        )
    ]


@register()
def check_sqlite(app_configs=None, databases=None, **kwargs):
    """Warn when the jobs' SQLite database would make callers fail with "database is locked".

    On Django's default SQLite settings a transaction starts deferred and takes the write
    lock at its first write; when two writers meet, SQLite cannot wait for one of them
    and ``jobs.request()`` raises ``OperationalError: database is locked`` (a burst of 60
    enqueues did, in a fresh project). ``transaction_mode="IMMEDIATE"`` takes the lock at
    ``BEGIN``, where the busy timeout waits, and WAL lets readers go on meanwhile. Read
    from the settings alone (no connection is opened); an in-memory database is not
    judged for WAL.
    """
    alias = router.db_for_write(apps.get_model("jobs", "Job"))
    conn = connections[alias]
    if conn.vendor != "sqlite":
        return []
    options = conn.settings_dict.get("OPTIONS") or {}
    missing = []
    if str(options.get("transaction_mode") or "").upper() != "IMMEDIATE":
        missing.append('"transaction_mode": "IMMEDIATE"')
    name = str(conn.settings_dict.get("NAME") or "")
    in_memory = name == ":memory:" or "mode=memory" in name
    init = str(options.get("init_command") or "").lower().replace(" ", "")
    if not in_memory and "journal_mode=wal" not in init:
        missing.append('"init_command": "PRAGMA journal_mode=WAL; ..."')
    if not missing:
        return []
    options_missing = " and ".join(missing)
    return [
        Warning(
            f"the jobs' database {alias!r} is SQLite without {options_missing}",
            hint="Concurrent writers then fail with 'database is locked' instead of waiting. "
            f"Add to settings.py: DATABASES[{alias!r}]['OPTIONS'] = {{'transaction_mode': "
            "'IMMEDIATE', 'timeout': 20, 'init_command': 'PRAGMA journal_mode=WAL; "
            "PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=20000;'}",
            id="jobs.W015",
        )
    ]


def _routes_metrics(patterns, depth: int = 0) -> bool:
    """Whether the URLconf serves the app's metrics view (by its URL name or function)."""
    for pattern in patterns:
        nested = getattr(pattern, "url_patterns", None)
        if nested is not None:
            if depth < 8 and _routes_metrics(nested, depth + 1):
                return True
            continue
        callback = getattr(pattern, "callback", None)
        if getattr(pattern, "name", None) == "jobs-metrics" or (
            getattr(callback, "__name__", "") == "metrics_view"
            and str(getattr(callback, "__module__", "")).startswith("jobs.")
        ):
            return True
    return False


@register(Tags.urls)
def check_metrics(app_configs=None, **kwargs):
    """Warn when the metrics URL is routed but ``prometheus_client`` is not installed.

    The view then answers a plain-text 404 that names the extra; a scraper sees only
    that the target is down, so the check says it at start-up.
    """
    if importlib.util.find_spec("prometheus_client") is not None:
        return []
    from django.urls import get_resolver

    try:
        routed = _routes_metrics(get_resolver().url_patterns)
    except Exception:  # a broken URLconf is Django's own check's to report
        return []
    if not routed:
        return []
    return [
        Warning(
            "the jobs metrics URL is routed but prometheus_client is not installed",
            hint="pip install 'django-jobs-ledger[metrics]', or drop the include of "
            "jobs.urls; until then the metrics URL answers 404.",
            id="jobs.W016",
        )
    ]


# Checks of one part live in that part's module; they are registered here, with the rest.
register()(artifacts.check_storage)
register()(artifacts.check_exclusive_create)
register()(queue.check_django_q)
register()(queue.check_broker)
register()(retention.check_retention_days)
register()(archive.check_archive_days)
register()(email.check_email_timing)
register()(schedules.check_schedules)
register(Tags.database)(executors.check_hot_path)
