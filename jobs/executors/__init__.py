"""One executor per database, chosen once per process (``current``).

``postgres``: PostgreSQL through psycopg 3, one statement for the claim and for the
publish. ``orm``: every other database (SQLite, psycopg2) through Django's ORM. Both
implement ``jobs.executors.contract.Executor``; the engine never asks which it has.
"""

from __future__ import annotations

import functools
from typing import cast

from jobs.executors.contract import Executor


def path() -> tuple[str, str]:
    """The executor the default connection gets, and why (``manage.py check`` shows it)."""
    from jobs.executors import postgres

    fast, why = postgres.path()
    return ("postgres" if fast else "orm"), why


@functools.cache
def current() -> Executor:
    """This process's executor (the database does not change under a running process)."""
    return by_name(path()[0])


def by_name(name: str) -> Executor:
    """An executor by name (``postgres`` or ``orm``): the contract test runs each."""
    from jobs.executors import orm, postgres

    return cast(Executor, {"postgres": postgres, "orm": orm}[name])


def check_hot_path(app_configs=None, databases=None, **kwargs):
    """Say which path the claim and the publish take here, and why."""
    from django.core.checks import Info

    if not databases or "default" not in databases:
        return []
    _, why = path()
    return [Info(f"jobs hot path: {why}", id="jobs.I001")]
