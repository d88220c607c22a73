"""What the PostgreSQL statements share: their cursor, names, and rows read back.

A psycopg 3 cursor wrapped like Django's own (errors translated, queries logged),
prepared when ``JOBS_PREPARED_STATEMENTS`` says so; table and column names quoted only
where PostgreSQL needs it; a ``Job`` built from a statement's ``RETURNING *`` in any
column order. The next-job claim (``pgclaim``) and the executor's publish
(``postgres``) use these; psycopg is imported only when a statement runs.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

from django.db import connection, models

from jobs import conf
from jobs.models import Job

NOW = "clock_timestamp()"


def _int8(value: int):
    from psycopg.types.numeric import Int8

    return Int8(value)


class _Prepared:
    """A psycopg cursor whose statements are prepared (parsed and planned once per connection).

    Django turns psycopg's automatic preparing off (poolers in transaction mode lose
    prepared statements); ``JOBS_PREPARED_STATEMENTS`` turns it on for these few
    statements only. The ORM's client-side binding cursors are not affected.
    """

    def __init__(self, cursor, prepare: bool):
        self._cursor, self._prepare = cursor, prepare
        self._query = None

    def execute(self, sql: str, params=None):
        # What Django's query log shows: the statement with its placeholders, no values.
        self._query = SimpleNamespace(query=sql.encode())
        return self._cursor.execute(sql, params, prepare=self._prepare)

    def __getattr__(self, name: str):
        return getattr(self._cursor, name)


@contextmanager
def _cursor(*, health_check: bool = True) -> Iterator:
    """A cursor with server-side binding, prepared statements if configured.

    Wrapped like Django's own cursors (errors translated, execute wrappers run,
    queries logged under DEBUG and in ``CaptureQueriesContext``). ``health_check=False``:
    the statement is its own check (``_claim_row_checked``).
    """
    import psycopg

    if health_check:
        connection.close_if_health_check_failed()  # what Django's own cursor() does first
    connection.ensure_connection()
    prepare = conf.prepared_statements()
    pg = connection.connection
    if prepare and pg.prepare_threshold is None:
        # psycopg prepares nothing while the threshold is None (Django's default); a
        # huge one keeps automatic preparing off and lets ``prepare=True`` through.
        pg.prepare_threshold = 2**31 - 1
    with connection.wrap_database_errors:
        raw = psycopg.Cursor(pg)
    cursor = connection._prepare_cursor(_Prepared(raw, prepare))
    try:
        yield cursor
    finally:
        cursor.close()


# PostgreSQL's reserved key words (and those reserved as names): these need quotes.
_WORDS = """all analyse analyze and any array as asc asymmetric authorization binary both case
    cast check collate collation column concurrently constraint create cross current_catalog
    current_date current_role current_schema current_time current_timestamp current_user
    default deferrable desc distinct do else end except false fetch for foreign freeze from
    full grant group having ilike in initially inner intersect into is isnull join lateral
    leading left like limit localtime localtimestamp natural not notnull null offset on only
    or order outer overlaps placing primary references returning right select session_user
    similar some symmetric system_user table tablesample then to trailing true union unique
    user using variadic verbose when where window with"""
_RESERVED = frozenset(_WORDS.split())


def _q(name: str) -> str:
    """A table or column name from a model (never from input), quoted only if it must be:
    the publish statement stays under 4 KiB, which psycopg keeps parsed."""
    if name.isidentifier() and name.islower() and name not in _RESERVED:
        return name
    return f'"{name}"'


_JOB_ATTNAMES = [f.attname for f in Job._meta.concrete_fields]


def _job_from_row(columns: list[str], values: list) -> Job:
    """A ``Job`` from its table's columns in any order (each converted by its field)."""
    if len(columns) != len(values):
        raise ValueError(f"{len(values)} values for {len(columns)} columns")
    ordered = [values[i] for i in _field_order(tuple(columns))]
    return Job.from_db(connection.alias, _JOB_ATTNAMES, _convert(Job, ordered))


@functools.cache
def _field_order(columns: tuple[str, ...]) -> tuple[int, ...]:
    """Where each of the job's fields is in a row of ``columns``."""
    at = {name: i for i, name in enumerate(columns)}
    return tuple(at[f.column] for f in Job._meta.concrete_fields)


@functools.cache
def _converters(model: type[models.Model]) -> tuple:
    """Per column, the field's own from-the-database converters (e.g. JSON text → dict)."""
    return tuple(tuple(f.get_db_converters(connection)) for f in model._meta.concrete_fields)


def _convert(model: type[models.Model], values: list) -> list:
    out = []
    fields = model._meta.concrete_fields
    for value, converters, f in zip(values, _converters(model), fields, strict=True):
        for convert in converters:
            value = convert(value, f.get_col(model._meta.db_table), connection)
        out.append(value)
    return out


# --- publish --------------------------------------------------------------------------


# Inserted columns of each table, without the primary key and the parent's foreign key
# (the statement takes those from the rows it has just written).


def _compact(statement: str) -> str:
    """One line, single spaces: under 4 KiB psycopg keeps the parsed statement too."""
    return " ".join(statement.split())


_LITERAL = re.compile(r"'(?:[^']|'')*'")
_SPACED = ("( ", " )", ", ", " = ", " <> ", " >= ", " <= ", " || ", " < ", " > ", " + ", " => ")


def _tight(statement: str) -> str:
    """``_compact`` and no space inside parentheses, after a comma or around an operator,
    outside string literals: a long statement kept under psycopg's 4 KiB parse cache."""
    text = _compact(statement)
    parts, at = [], 0
    for literal in _LITERAL.finditer(text):
        parts += [_tighten(text[at : literal.start()]), literal.group()]
        at = literal.end()
    return "".join([*parts, _tighten(text[at:])])


def _tighten(text: str) -> str:
    for spaced in _SPACED:
        text = text.replace(spaced, spaced.strip())
    return text


def _json(value) -> dict:
    if value is None:
        return {}
    return json.loads(value) if isinstance(value, str) else dict(value)
