"""One clock: the database server's.

Every lease, due time and expiry is written and compared inside the SQL
statement with the server's ``now()``, never with a worker's clock, so workers
on machines whose clocks disagree still agree on who holds what. (Timestamps
that are only shown to people may come from anywhere.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TypeVar

from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import DateTimeField, ExpressionWrapper
from django.db.models.functions import Now

log = logging.getLogger("jobs.clock")
T = TypeVar("T")

__all__ = [
    "Now",
    "ServerNow",
    "after",
    "before",
    "checked_by",
    "server_now",
    "worker_transaction",
]


class ServerNow(Now):
    """The server's clock when the statement reads it (``clock_timestamp()`` on
    PostgreSQL, not the statement's start): a statement that waited for a lock judges
    a lease by the time it writes. The PostgreSQL executor's statements
    (``jobs.executors.postgres``) read it too."""

    def as_postgresql(self, compiler, connection, **extra_context):
        return self.as_sql(compiler, connection, template="CLOCK_TIMESTAMP()", **extra_context)


def after(seconds: float) -> ExpressionWrapper:
    """The server's clock plus ``seconds``, evaluated in the statement that writes it."""
    return ExpressionWrapper(ServerNow() + timedelta(seconds=seconds), output_field=DateTimeField())


def before(seconds: float) -> ExpressionWrapper:
    """The server's clock minus ``seconds``, evaluated in the statement that compares it."""
    return ExpressionWrapper(ServerNow() - timedelta(seconds=seconds), output_field=DateTimeField())


def server_now() -> datetime:
    """The database server's clock, read once (this host's on SQLite, where the server is
    this host): a constant bound an index can take, where ``before`` cannot."""
    from django.utils import timezone

    if connection.vendor != "postgresql":
        return timezone.now()
    with connection.cursor() as cursor:
        cursor.execute("SELECT CLOCK_TIMESTAMP()")
        return cursor.fetchone()[0]


@contextmanager
def worker_transaction() -> Iterator[None]:
    """A worker's transaction that the database ends before the worker's lease ends.

    On PostgreSQL an outermost worker transaction carries a server-side idle timeout
    and a lock timeout (``SET LOCAL``: they end with it). A worker frozen inside it
    (SIGSTOP, a stalled VM) is cut off by the server, so its commit fails; the owner
    CAS in it demands at least that much lease left (``compare_and_swap(margin=)``).
    Nested in a caller's transaction it changes nothing: the caller owns its timeouts.
    """
    from jobs import conf

    outermost = not connection.in_atomic_block
    with transaction.atomic():
        if outermost and connection.vendor == "postgresql":
            idle = max(1, int(conf.transaction_idle_seconds() * 1000))
            lock = max(1, int(conf.lock_timeout_seconds() * 1000))
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SET LOCAL idle_in_transaction_session_timeout = {idle}; "
                    f"SET LOCAL lock_timeout = {lock}"
                )
        yield


def checked_by(read: Callable[[], T]) -> T:
    """Run ``read`` (idempotent, a task's first query) as its connection's health check.

    django-q2 closes obsolete connections before every task, and Django then checks the
    kept one with a ``SELECT 1`` before its first query (``CONN_HEALTH_CHECKS``): one
    round trip a task. Here the read is the check: a connection that died while idle
    (a server restart, an idle timeout) fails the read, is dropped, and the read is sent
    once more on a fresh connection. An error on a connection that still answers (a
    lock timeout) is the read's own and is raised.
    """
    if (
        connection.connection is None
        or connection.health_check_done
        or not connection.health_check_enabled
        or connection.in_atomic_block
    ):
        return read()
    connection.health_check_done = True  # Django skips its own check for this read
    try:
        return read()
    except (OperationalError, InterfaceError):
        if connection.is_usable():
            raise
        log.info("the idle connection was gone at a task's first read; reading again")
        connection.close()
        return read()
