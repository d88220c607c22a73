"""The hot path's two statements, hand-written: the claim and the publish (PostgreSQL).

Everything else in the engine speaks the ORM. These two run once per job, and the
ORM would need five round trips for the claim and eight for the publish; each here
is one statement in autocommit, so it is also one transaction and one commit.
Every condition of the ORM's compare-and-swap is kept (version, owner, a live
lease by the server's clock, due time, attempt budget, tenant bound); a statement
that matches no row changes nothing, and the caller falls back to the ORM path,
which records why (duplicate, deferred, buried).

Fences read ``clock_timestamp()``, not the statement's start: a statement that
waited for a lock judges the lease by the time it actually writes. The publish
never waits for the job's row (``FOR UPDATE NOWAIT``): if another transaction holds
it, the statement fails at once and the ORM path, whose transaction carries the
lock timeout (``clock.worker_transaction``), publishes instead. Being one
statement in autocommit, neither can be left idle in a transaction by a frozen
worker: the server commits it, or nothing, by itself.

SQLite and custom transactional providers take the ORM path (``transitions``,
``ledger.record``); the ``jobs_tenant_admits`` function comes from migration 0007.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from types import SimpleNamespace

import psycopg
from django.contrib.auth import get_user_model
from django.core.exceptions import FieldDoesNotExist
from django.db import connection, models
from django.db.models.functions import Now
from psycopg.types.numeric import Int8

from jobs import conf
from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, Notice

NOW = "clock_timestamp()"


def available() -> bool:
    """Whether the one-statement paths apply to the default connection."""
    return connection.vendor == "postgresql"


class _Prepared:
    """A psycopg cursor whose statements are prepared (parsed and planned once per connection).

    Django turns psycopg's automatic preparing off (poolers in transaction mode lose
    prepared statements); ``JOBS_PREPARED_STATEMENTS`` turns it on for these few
    statements only. The ORM's client-side binding cursors are not affected.
    """

    def __init__(self, cursor: psycopg.Cursor, prepare: bool):
        self._cursor, self._prepare = cursor, prepare
        self._query = None

    def execute(self, sql: str, params=None):
        # What Django's query log shows: the statement with its placeholders, no values.
        self._query = SimpleNamespace(query=sql.encode())
        return self._cursor.execute(sql, params, prepare=self._prepare)

    def __getattr__(self, name: str):
        return getattr(self._cursor, name)


@contextmanager
def _cursor() -> Iterator:
    """A cursor with server-side binding, prepared statements if configured.

    Wrapped like Django's own cursors (errors translated, execute wrappers run,
    queries logged under DEBUG and in ``CaptureQueriesContext``).
    """
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


# --- claim ----------------------------------------------------------------------------


def claim(job_id: int, worker: str, *, lease: float, bound: int) -> tuple[Job, Attempt] | None:
    """queued or due retry_wait → running, with its attempt row, in one statement.

    Returns ``(job, attempt)`` or None when the job is not plainly claimable now
    (not due, running, finished, budget spent, tenant at its bound, missing):
    the ORM claim then decides and records what that delivery was.
    """
    job_t, attempt_t = _q(Job._meta.db_table), _q(Attempt._meta.db_table)
    columns = ", ".join(_q(f.column) for f in Job._meta.concrete_fields)
    S = Job.State
    sql = f"""
        WITH claimed AS (
            UPDATE {job_t} SET
                state = %s, attempts = attempts + 1, lease_owner = %s,
                lease_expires_at = {NOW} + make_interval(secs => %s),
                next_attempt_at = NULL, started_at = COALESCE(started_at, {NOW}),
                version = version + 1, updated_at = {NOW}
            WHERE id = %s
              AND state IN (%s, %s)
              AND (next_attempt_at IS NULL OR next_attempt_at <= {NOW})
              AND attempts < max_attempts
              AND (tenant_key = '' OR jobs_tenant_admits(tenant_key, id, %s::integer))
            RETURNING {columns}
        ), attempt AS (
            INSERT INTO {attempt_t}
                (job_id, number, worker, started_at, outcome, error_class, error_code)
            SELECT id, attempts, %s, {NOW}, '', '', '' FROM claimed
            RETURNING id, started_at
        )
        SELECT claimed.*, attempt.id, attempt.started_at FROM claimed CROSS JOIN attempt
    """
    params = [S.RUNNING, worker, float(lease), Int8(job_id), S.QUEUED, S.RETRY_WAIT, Int8(bound)]
    params.append(worker)
    with _cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None:
        return None
    *values, attempt_id, db_now = row
    job = Job.from_db(connection.alias, _JOB_ATTNAMES, _convert(Job, values))
    job.db_now = db_now
    attempt = Attempt(pk=attempt_id, job=job, number=job.attempts, worker=worker, started_at=db_now)
    attempt._state.adding, attempt._state.db = False, job._state.db
    return job, attempt


def still_owner(job: Job, worker: str) -> bool:
    """Whether ``worker`` holds ``job`` at the version it last wrote, on a live lease."""
    sql = f"""
        SELECT 1 FROM {_q(Job._meta.db_table)}
        WHERE id = %s AND version = %s AND lease_owner = %s AND state = %s
          AND lease_expires_at > {NOW}
    """
    with _cursor() as cursor:
        cursor.execute(sql, [Int8(job.pk), Int8(job.version), worker, Job.State.RUNNING])
        return cursor.fetchone() is not None


_JOB_ATTNAMES = [f.attname for f in Job._meta.concrete_fields]


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


@dataclass
class Published:
    won: bool  # the CAS: the job is succeeded and everything below committed with it
    recipients_changed: bool = False  # refused: an account to notify is gone or inactive
    artifact_id: int | None = None
    effect_ids: dict[str, int] = field(default_factory=dict)  # effect_id → pk
    notice_ids: dict[str, int] = field(default_factory=dict)  # effect_id → notice pk


# Inserted columns of each table, without the primary key and the parent's foreign key
# (the statement takes those from the rows it has just written).
_SKIP = {Artifact: "job_id", Effect: "job_id", Notice: "effect_id", EffectEvent: "effect_id"}


@functools.cache
def _fields(model: type[models.Model]) -> tuple:
    return tuple(
        f for f in model._meta.concrete_fields if not f.primary_key and f.attname != _SKIP[model]
    )


def _record_type(model: type[models.Model], *, key: bool = False) -> str:
    """The column list ``jsonb_to_recordset`` reads the rows of ``model`` with."""
    defs = [f"{_q(f.column)} {f.cast_db_type(connection)}" for f in _fields(model)]
    return ", ".join((["_key text"] if key else []) + defs)


def _rows_json(model: type[models.Model], objs: list, key=None) -> str:
    """The unsaved rows as one JSON array: one parameter, whatever their number."""
    out = []
    for obj in objs:
        row = {} if key is None else {"_key": key(obj)}
        for f in _fields(model):
            value = getattr(obj, f.attname)
            if isinstance(value, models.Expression | Now):
                raise TypeError(f"{model.__name__}.{f.name}: expressions are not written here")
            if isinstance(value, datetime):
                value = value.isoformat()
            elif not isinstance(f, models.JSONField):
                value = f.get_prep_value(value)
            row[f.column] = value
        out.append(row)
    return json.dumps(out, default=str)


@functools.cache
def _publish_statement(changes: tuple[tuple[str, bool], ...]) -> str:
    """The publish, one text for every job (so the server plans it once per connection).

    ``changes``: ``(field name, is the server's clock)`` of the job's publish columns.
    """
    job_t = _q(Job._meta.db_table)
    user = get_user_model()
    try:
        active = user._meta.get_field("is_active")
        inactive = f" OR NOT u.{_q(active.column)}" if active.concrete else ""
    except FieldDoesNotExist:
        inactive = ""
    pk = user._meta.pk
    sets = ["version = version + 1", f"updated_at = {NOW}"]
    for name, clock in changes:
        sets.append(f"{_q(Job._meta.get_field(name).column)} = {NOW if clock else '%s'}")

    def cols(model, prefix="v."):
        return ", ".join(prefix + _q(f.column) for f in _fields(model))

    def names(model):
        return ", ".join(_q(f.column) for f in _fields(model))

    effect_picks = ", ".join(
        "COALESCE('notice:' || n.id, v.provider_ref)"
        if f.column == "provider_ref"
        else f"v.{_q(f.column)}"
        for f in _fields(Effect)
    )
    return _compact(f"""
        WITH refused_recipient AS (
            SELECT r.id FROM jsonb_array_elements_text(%s::jsonb) AS r(id)
            LEFT JOIN {_q(user._meta.db_table)} u
                   ON u.{_q(pk.column)} = r.id::{pk.cast_db_type(connection)}
            WHERE u.{_q(pk.column)} IS NULL{inactive}
        ), locked AS (
            SELECT id FROM {job_t} WHERE id = %s FOR UPDATE NOWAIT
        ), job AS (
            UPDATE {job_t} SET {", ".join(sets)}
            WHERE id = (SELECT id FROM locked) AND version = %s AND lease_owner = %s
              AND lease_expires_at > {NOW} + make_interval(secs => %s)
              AND NOT EXISTS (SELECT 1 FROM refused_recipient)
            RETURNING id
        ), attempt AS (
            UPDATE {_q(Attempt._meta.db_table)} SET outcome = %s, finished_at = {NOW}
            WHERE id = %s AND EXISTS (SELECT 1 FROM job)
            RETURNING id
        ), artifact AS (
            INSERT INTO {_q(Artifact._meta.db_table)} (job_id, {names(Artifact)})
            SELECT job.id, {cols(Artifact)}
            FROM job, jsonb_to_recordset(%s::jsonb) AS v({_record_type(Artifact)})
            ON CONFLICT (key) DO NOTHING
            RETURNING id
        ), notice_row AS MATERIALIZED (
            SELECT v.*, nextval(pg_get_serial_sequence('{Notice._meta.db_table}', 'id')) AS id
            FROM job, jsonb_to_recordset(%s::jsonb) AS v({_record_type(Notice, key=True)})
        ), effect AS (
            INSERT INTO {_q(Effect._meta.db_table)} (job_id, {names(Effect)})
            SELECT job.id, {effect_picks}
            FROM job, jsonb_to_recordset(%s::jsonb) AS v({_record_type(Effect)})
            LEFT JOIN notice_row n ON n._key = v.effect_id
            RETURNING id, effect_id
        ), notice AS (
            INSERT INTO {_q(Notice._meta.db_table)} (id, effect_id, {names(Notice)})
            SELECT n.id, e.id, {cols(Notice, "n.")}
            FROM notice_row n JOIN effect e ON e.effect_id = n._key
            RETURNING effect_id, id
        ), event AS (
            INSERT INTO {_q(EffectEvent._meta.db_table)} (effect_id, {names(EffectEvent)})
            SELECT e.id, {cols(EffectEvent)}
            FROM jsonb_to_recordset(%s::jsonb) AS v({_record_type(EffectEvent, key=True)})
            JOIN effect e ON e.effect_id = v._key
            RETURNING id
        )
        SELECT (SELECT count(*) FROM job), (SELECT count(*) FROM refused_recipient),
               (SELECT id FROM artifact),
               (SELECT json_object_agg(effect_id, id) FROM effect),
               (SELECT json_object_agg(_key, id) FROM notice_row)
    """)


def publish(
    job: Job,
    worker: str,
    *,
    changes: dict,
    margin: float,
    attempt_id: int,
    artifact: Artifact | None,
    effects: list[Effect],
    notices: list[Notice],
    events: list[EffectEvent],
    recipients: list[str],
) -> Published:
    """running → succeeded with everything that commits with it, in one statement.

    ``changes``: the job's publish columns (``transitions.publish_changes``; an
    expression there can only be ``Now()``). The effects are born in their final
    state (applied or withheld); ``notices`` and ``events`` name their effect by
    an ``effect_key`` attribute (the effect's ``effect_id``: nothing has a pk yet).
    The attempt's outcome is written only if the CAS won.

    ``recipients``: user ids whose account must exist and be active for the publish
    to happen at all (the default release policy, ``ledger.withhold_reason``, checked
    in the statement that commits the notices). If one fails, nothing is written and
    ``recipients_changed`` says so: the caller decides those effects the slow way.
    """
    statement = _publish_statement(tuple((k, isinstance(v, Now)) for k, v in changes.items()))
    params = [json.dumps(recipients), Int8(job.pk)]
    params += [v for v in changes.values() if not isinstance(v, Now)]
    params += [Int8(job.version), worker, float(margin)]
    params += [Attempt.Outcome.SUCCEEDED, Int8(attempt_id)]
    params.append(_rows_json(Artifact, [artifact] if artifact is not None else []))
    params.append(_rows_json(Notice, notices, key=lambda n: n.effect_key))
    params.append(_rows_json(Effect, effects))
    params.append(_rows_json(EffectEvent, events, key=lambda ev: ev.effect_key))
    with _cursor() as cursor:
        cursor.execute(statement, params)
        won, refused, artifact_id, effect_ids, notice_ids = cursor.fetchone()
    if not won:
        return Published(False, recipients_changed=bool(refused))
    return Published(True, False, artifact_id, _json(effect_ids), _json(notice_ids))


def _compact(statement: str) -> str:
    """One line, single spaces: under 4 KiB psycopg keeps the parsed statement too."""
    return " ".join(statement.split())


def _json(value) -> dict:
    if value is None:
        return {}
    return json.loads(value) if isinstance(value, str) else dict(value)
