"""Scratch PostgreSQL databases: made, used and dropped by a test, drill, soak or benchmark.

One helper for URLs too: user names and passwords are percent-quoted when a URL
is built from Django's ``DATABASES`` entry, so a password with ``@`` or ``/``
still names the right server.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from urllib.parse import quote, urlsplit, urlunsplit

POSTGRES_SCHEMES = ("postgres", "postgresql", "pgsql", "postgis")
# Only names this helper could have made are ever dropped.
_SCRATCH_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")


class NotPostgres(RuntimeError):
    """Raised when a scratch database is asked of a server that is not PostgreSQL."""


def server_url(url: str | None = None, *, purpose: str = "this run") -> str:
    """``url`` (default ``DATABASE_URL``) if it names a PostgreSQL server, else NotPostgres."""
    url = os.environ.get("DATABASE_URL", "") if url is None else url
    scheme = urlsplit(url).scheme.lower()
    if scheme not in POSTGRES_SCHEMES:
        shown = repr(scheme) if scheme else "unset (SQLite)"
        raise NotPostgres(
            f"{purpose} needs PostgreSQL, but DATABASE_URL is {shown}. Set e.g. "
            "DATABASE_URL=postgres://USER@HOST:PORT/DB; scratch databases are created "
            "and dropped on that server."
        )
    return url


def with_database(url: str, name: str) -> str:
    """The same server and credentials with the database name replaced."""
    parts = urlsplit(url)
    return urlunsplit(("postgresql", parts.netloc, f"/{quote(name)}", parts.query, ""))


def url_from_settings(db: Mapping, name: str | None = None) -> str:
    """A ``postgresql://`` URL for a Django ``DATABASES`` entry (``name`` replaces NAME)."""
    user = quote(str(db.get("USER") or ""), safe="")
    password = quote(str(db.get("PASSWORD") or ""), safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = str(db.get("HOST") or "127.0.0.1")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    port = db.get("PORT") or 5432
    return f"postgresql://{auth}{host}:{port}/{quote(str(name or db['NAME']), safe='')}"


def _check_name(name: str) -> str:
    if not _SCRATCH_NAME.fullmatch(name):
        raise ValueError(f"not a scratch database name: {name!r}")
    return name


@contextlib.contextmanager
def admin_connection(url: str):
    """Autocommit connection to the server's maintenance database (or the URL's own)."""
    import psycopg

    last = None
    for candidate in ("postgres", urlsplit(url).path.lstrip("/"), "template1"):
        if not candidate:
            continue
        try:
            conn = psycopg.connect(with_database(url, candidate), autocommit=True)
        except psycopg.OperationalError as exc:
            last = exc
            continue
        with conn:
            yield conn
        return
    raise last  # type: ignore[misc]


def create(url: str, name: str, *, if_missing: bool = False) -> str:
    """Create database ``name`` on the server of ``url``; returns its URL."""
    _check_name(name)
    with admin_connection(url) as conn:
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not (found and if_missing):
            conn.execute(f'CREATE DATABASE "{name}"')
    return with_database(url, name)


def drop(url: str, name: str) -> None:
    """Drop database ``name`` (sessions still in it are ended first)."""
    _check_name(name)
    with admin_connection(url) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
