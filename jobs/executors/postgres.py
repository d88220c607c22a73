"""The PostgreSQL executor: the claim and the publish as one hand-written statement each.

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

Their conditions are not spelled here: the claimability, the owner fence, the live
lease and the account release rule come from ``jobs.rules``, which renders the same
definitions for the ORM. The publish carries out a ``jobs.engine.plan.Plan``; the
ORM executor (``jobs.executors.orm``) carries out the same plan and the same claim
for the documented refusals: a plan with effects that need a queue message or a
provider's own code, the job's row locked elsewhere, a recipient deleted mid-publish,
and a claim the statement could not plainly make (the ORM claim then decides and
records what the delivery was, by the same admission). The tenant and flow functions
come from migrations 0008 and 0014. psycopg is imported only when a statement runs:
a site on SQLite or psycopg2 never loads it.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime
from types import SimpleNamespace

from django.contrib.auth import get_user_model
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    connection,
    models,
    transaction,
)
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now

from jobs import conf, rules
from jobs.engine import effect_machine, job_machine
from jobs.engine.plan import Claim, Plan, Result, Status
from jobs.engine.refusals import refusal
from jobs.executors import orm
from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, Notice

log = logging.getLogger("jobs.executors")

name = "postgres"

NOW = "clock_timestamp()"


def path() -> tuple[bool, str]:
    """Whether the one-statement paths apply to the default connection, and why (or why not)."""
    if connection.vendor != "postgresql":
        return False, f"the database is {connection.vendor}, not PostgreSQL: the ORM path"
    try:
        from django.db.backends.postgresql.psycopg_any import is_psycopg3
    except ImportError:  # pragma: no cover - no driver at all
        is_psycopg3 = False
    if not is_psycopg3:
        return False, "PostgreSQL through psycopg2: the ORM path (psycopg 3 is needed)"
    return True, "PostgreSQL through psycopg 3: one statement for the claim and the publish"


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


# --- claim ----------------------------------------------------------------------------


@functools.cache
def _claim_statement() -> str:
    job_t = _q(Job._meta.db_table)
    # A job whose kind or tenant has an active flow rule: the rules are judged by
    # ``jobs_flow_admits_v2`` (jobs.rules.flow_function_sql); otherwise the tenant bound
    # (``start_ctes``). Admission runs once, in a CTE of its own, never in the UPDATE's
    # WHERE (which the server may evaluate again after a concurrent update). The chosen
    # job's own advisory claim lock is tried first (never waited for): a racing delivery
    # of the same job finds it taken and leaves the job to the ORM claim, so a ruled
    # job's admission never takes rate starts it cannot use, and an ORM claim deciding
    # about this job (it holds the same lock, ``orm._claim_lock``) is never waited for
    # here while this statement holds a scope's lock that claim waits for (no deadlock).
    # (Locking the row itself would cost every claim a second write of the tuple: +0.3
    # ms a claim. The next-job claim, ``pgclaim``, locks its candidates' rows instead.)
    # The job to claim (docs/app/scheduling.md): the named job, unless its queue has a
    # due job at least SWAP_MARGIN levels more urgent by effective priority (two index
    # scans: the best by priority, the longest waiting); a named job that must have its
    # own verdict (OWN_VERDICT) goes to the ORM claim. Literal states: the partial
    # indexes of migration 0017 apply to the prepared statement too.
    now_claimable = rules.literal_sql(rules.CLAIMABLE, Job, quote=_q, now="t.now")
    own = rules.literal_sql(rules.OWN_VERDICT, Job, quote=_q, now="t.now")
    # The candidates read the queue and the clock as scalars (init plans), not by a join:
    # joined, the job table is the inner side and its partial index's order is lost (two
    # sorts of every due job of the queue: 9 ms a claim with 6,000 queued); as scalars
    # each candidate is the first row of an index scan.
    t_now, n_queue = "(SELECT now FROM t)", "(SELECT queue FROM named)"
    cand_claimable = rules.literal_sql(rules.CLAIMABLE, Job, alias="j", quote=_q, now=t_now)
    since = rules.waiting_since_sql("j")
    eff_j = rules.effective_priority_sql("j", now=t_now)
    candidate = f"""
        SELECT j.id, {eff_j} AS eff, {since} AS since FROM {job_t} j
        WHERE j.queue = {n_queue} AND {cand_claimable}"""
    text = f"""
        WITH t AS MATERIALIZED (
            SELECT {NOW} AS now,
                CASE WHEN %s THEN set_config('synchronous_commit', 'off', true) END AS quick
        ), named AS MATERIALIZED (
            SELECT id, queue, {now_claimable} AS ok, {own} AS own,
                {rules.effective_priority_sql(now="t.now")} AS eff
            FROM {job_t}, t WHERE id = %s
        ), candidate AS MATERIALIZED (
            SELECT c.id, c.eff FROM (
                ({candidate} ORDER BY j.priority DESC, {since}, j.id LIMIT 1)
                UNION ALL
                ({candidate} ORDER BY {since}, j.id LIMIT 1)
            ) c ORDER BY c.eff DESC, c.since, c.id LIMIT 1
        ), chosen AS MATERIALIZED (
            SELECT CASE WHEN n.own THEN NULL
                WHEN n.ok AND (c.id IS NULL OR c.eff < n.eff + %s::float8) THEN n.id
                ELSE c.id END AS id
            FROM named n LEFT JOIN candidate c ON true
        ), {start_ctes("chosen")}
        SELECT claimed.*, attempt.id, attempt.started_at,
            CASE WHEN claimed.id IS NULL THEN EXISTS (
                SELECT 1 FROM locked l WHERE l.tenant_key <> '' AND NOT
                    pg_try_advisory_xact_lock({rules.TENANT_LOCK_CLASS}, hashtext(l.tenant_key))
            ) END AS tenant_busy
        FROM (SELECT 1) one LEFT JOIN (claimed CROSS JOIN attempt) ON true
    """
    return _compact(text)


def start_ctes(source: str) -> str:
    """The claim's last steps on the job ``(SELECT id FROM <source>)``, as CTEs: its claim
    lock tried, the admission, the start (the CAS) and the attempt row. One text for the
    named claim and the next-job claim (``jobs.executors.pgclaim``); its parameters are
    ``start_params``'s."""
    job_t, attempt_t = _q(Job._meta.db_table), _q(Attempt._meta.db_table)
    claimable = rules.to_sql(rules.CLAIMABLE, Job, quote=_q)
    ruled = rules.flow_ruled_sql(job_t, quote=_q)
    queue_ruled = rules.queue_ruled_sql(job_t, quote=_q)
    assert not ruled.slots and not queue_ruled.slots, "the rule conditions have no parameters"
    return f"""locked AS MATERIALIZED (
            SELECT id, tenant_key FROM {job_t}
            WHERE id = (SELECT id FROM {source}) AND {claimable.text}
              AND NOT {queue_ruled.text}
              AND pg_try_advisory_xact_lock({rules.CLAIM_LOCK_CLASS}, hashtext(id::text))
        ), admitted AS MATERIALIZED (
            SELECT id FROM {job_t}
            WHERE id = (SELECT id FROM locked)
              AND CASE WHEN {ruled.text}
                    THEN jobs_flow_admits_v2(kind, tenant_key, id, %s::integer)
                    ELSE tenant_key = '' OR jobs_tenant_admits_v2(tenant_key, id, %s::integer)
                    END
        ), claimed AS (
            UPDATE {job_t} SET
                state = %s, attempts = attempts + 1, lease_owner = %s,
                lease_expires_at = {NOW} + make_interval(secs => %s),
                next_attempt_at = NULL, started_at = COALESCE(started_at, {NOW}),
                version = version + 1, updated_at = {NOW}
            WHERE id = (SELECT id FROM admitted) AND {claimable.text}
            RETURNING *
        ), attempt AS (
            INSERT INTO {attempt_t}
                (job_id, number, worker, started_at, outcome, error_class, error_code)
            SELECT id, attempts, %s, {NOW}, '', '', '' FROM claimed
            RETURNING id, started_at
        )"""


def start_params(worker: str, *, lease: float, bound: int) -> list:
    """``start_ctes``'s parameters, in their order."""
    claimable = rules.to_sql(rules.CLAIMABLE, Job, quote=_q).params()
    admission = [_int8(bound), _int8(bound)]
    return [*claimable, *admission, Job.State.RUNNING, worker, float(lease), *claimable, worker]


# The claim's statement is tried this often before the ORM claim decides, pausing
# STATEMENT_RETRY_PAUSE seconds times the try in between.
STATEMENT_TRIES = 3
STATEMENT_RETRY_PAUSE = 0.0005


def claim(job_id: int, worker: str, *, lease: float, bound: int) -> Claim:
    """queued or due retry_wait → running in one statement, or the ORM claim's verdict.

    When the job is not plainly claimable now (not due, running, finished, budget
    spent, a racing delivery of it holding its claim lock, the tenant at its bound or
    its lock busy,
    a flow rule of its kind or tenant holding it back, missing), the statement writes
    nothing and the ORM claim decides and records what that delivery was, by the same
    admission.
    """
    for tried in range(1, STATEMENT_TRIES + 1):
        claimed, tenant_busy = _claim_row_checked(job_id, worker, lease=lease, bound=bound)
        if claimed is not None or not tenant_busy or tried == STATEMENT_TRIES:
            break
        # Another claim of the job's tenant held the tenant's lock for the moment of its
        # own statement: trying again costs one round trip, the ORM claim several.
        time.sleep(STATEMENT_RETRY_PAUSE * tried)
    if claimed is None:
        return orm.claim(job_id, worker, lease=lease, bound=bound)
    job, attempt = claimed
    job_machine.log_arrow(job, "claim", worker, reclaimed=False)
    return Claim("claimed", job, attempt)


def claim_statement(job_id: int, worker: str, *, lease: float, bound: int) -> tuple[str, list]:
    """The claim's statement and its parameters (``EXPLAIN`` reads them in the tests)."""
    sql = _claim_statement()
    aging = rules.aging_seconds()
    # Alone in its transaction, the claim commits without waiting for the WAL flush
    # (docs/decisions.md, "Work starts when it is committed"); inside a caller's
    # transaction it changes nothing.
    quick = not connection.in_atomic_block
    params = [quick, aging, _int8(job_id), aging, aging, rules.SWAP_MARGIN]
    return sql, params + start_params(worker, lease=lease, bound=bound)


def claim_in_one(
    job_id: int, worker: str, *, lease: float, bound: int
) -> tuple[Job, Attempt] | None:
    """The claim's one statement: ``(job, attempt)`` (the attempt's ``started_at`` is the
    server's clock at the claim), or None having written nothing. The lease is computed
    by the server's clock when the row is written, after every lock is held."""
    return _claim_row(job_id, worker, lease=lease, bound=bound)[0]


def _claim_row_checked(
    job_id: int, worker: str, *, lease: float, bound: int
) -> tuple[tuple[Job, Attempt] | None, bool]:
    """``_claim_row`` as a delivery's first statement, which is also its connection's
    health check (``CONN_HEALTH_CHECKS``): Django's own check is a ``SELECT 1`` before the
    first query of every task, one round trip a delivery.

    A connection that died while idle (a server restart, an idle timeout) fails the
    claim before the server ran it; it is dropped and the claim is sent once more on a
    fresh connection. An error on a connection that still answers is the claim's own
    (a lock timeout): it is raised. A claim that did commit on a connection lost before
    its answer is found by the second one as a live lease: a duplicate delivery, and the
    job runs again when that lease expires, as when the check itself fails then.
    """
    if (
        connection.connection is None
        or connection.health_check_done
        or not connection.health_check_enabled
        or connection.in_atomic_block
    ):
        return _claim_row(job_id, worker, lease=lease, bound=bound)
    try:
        answer = _claim_row(job_id, worker, lease=lease, bound=bound, health_check=False)
    except (OperationalError, InterfaceError):
        if connection.is_usable():
            raise
        log.info("job=%s the idle connection was gone at the claim; claiming again", job_id)
        connection.close()
        return _claim_row(job_id, worker, lease=lease, bound=bound)
    connection.health_check_done = True  # the claim's answer: the connection is alive
    return answer


def _claim_row(
    job_id: int, worker: str, *, lease: float, bound: int, health_check: bool = True
) -> tuple[tuple[Job, Attempt] | None, bool]:
    """``claim_in_one``'s answer and, when it claimed nothing, whether the tenant's lock
    was held by another session at that moment (the claim may succeed when tried again)."""
    sql, params = claim_statement(job_id, worker, lease=lease, bound=bound)
    with _cursor(health_check=health_check) as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
        # The job's columns come in the table's order (RETURNING *, which keeps the
        # statement under psycopg's 4 KiB parse cache): read them by name, the names read
        # once a process (cursor.description builds an object per column, every call).
        names = _claim_columns.get(len(row))
        if names is None:
            names = _claim_columns[len(row)] = [d.name for d in cursor.description[:-3]]
    *values, attempt_id, db_now, tenant_busy = row
    if attempt_id is None:
        return None, bool(tenant_busy)
    job = _job_from_row(names, values)
    attempt = Attempt(pk=attempt_id, job=job, number=job.attempts, worker=worker, started_at=db_now)
    attempt._state.adding, attempt._state.db = False, job._state.db
    return (job, attempt), False


@functools.cache
def _still_owner_text() -> tuple[str, rules.Rendered]:
    fence = rules.to_sql(rules.STILL_OWNER, Job, quote=_q)
    return f"SELECT 1 FROM {_q(Job._meta.db_table)} WHERE {fence.text}", fence


def _still_owner_statement(job: Job, worker: str) -> tuple[str, list]:
    """The owner check's text (rendered once) and its parameters for ``job``/``worker``."""
    sql, fence = _still_owner_text()
    return sql, fence.params(
        job=_int8(job.pk), version=_int8(job.version), worker=worker, margin=0.0
    )


def still_owner(job: Job, worker: str) -> bool:
    """Whether ``worker`` holds ``job`` at the version it last wrote, on a live lease."""
    sql, params = _still_owner_statement(job, worker)
    with _cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone() is not None


def held_while(job: Job, worker: str) -> RawSQL:
    """``still_owner``'s statement as a condition of another query: the rule rendered
    once (compiling it as ORM lookups on every read cost more than the round trip)."""
    sql, params = _still_owner_statement(job, worker)
    return RawSQL(f"EXISTS ({sql})", params, output_field=models.BooleanField())


_JOB_ATTNAMES = [f.attname for f in Job._meta.concrete_fields]


# The claim's job columns by the length of its row (a migration that adds a column while a
# worker runs changes the length, and the names are read again).
_claim_columns: dict[int, list[str]] = {}


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


def _native_type(f: models.Field) -> type | None:
    """The Python type a column's value already has when the field would not change it
    (``get_prep_value`` is then the identity), or None."""
    if isinstance(f, models.ForeignKey):
        f = f.target_field
    if isinstance(f, models.BooleanField):
        return bool
    if isinstance(f, models.IntegerField | models.AutoField):
        return int
    if isinstance(f, models.CharField | models.TextField):
        return str
    return None


@functools.cache
def _row_writers(model: type[models.Model]) -> tuple:
    """Per column: attname, column, field, whether it is JSON, and its native type."""
    return tuple(
        (f.attname, f.column, f, isinstance(f, models.JSONField), _native_type(f))
        for f in _fields(model)
    )


def _rows_json(model: type[models.Model], objs: list, keys: list | None = None) -> str:
    """The unsaved rows as one JSON array: one parameter, whatever their number.

    ``keys``: per row, the effect_id it belongs to (nothing has a pk yet)."""
    out = []
    writers = _row_writers(model)
    for i, obj in enumerate(objs):
        row = {} if keys is None else {"_key": keys[i]}
        for attname, column, f, is_json, native in writers:
            value = getattr(obj, attname)
            if value is None or type(value) is native or is_json:
                pass  # as it is (a JSON column's value is its JSON)
            elif isinstance(value, models.Expression | Now):
                raise TypeError(f"{model.__name__}.{f.name}: expressions are not written here")
            elif isinstance(value, datetime):
                value = value.isoformat()
            else:
                value = f.get_prep_value(value)
            row[column] = value
        out.append(row)
    return json.dumps(out, default=str)


def _keyed_json(model: type[models.Model], pairs) -> str:
    """``(effect_id, row)`` pairs as JSON rows that name their effect by ``_key``."""
    return _rows_json(model, [row for _, row in pairs], keys=[key for key, _ in pairs])


@functools.cache
def _publish_statement(changes: tuple[tuple[str, bool], ...]) -> tuple[str, tuple]:
    """The publish, one text for every job (so the server plans it once per connection).

    ``changes``: ``(field name, is the server's clock)`` of the job's publish columns.
    Returns the text and the rendered rules it embeds (their parameters, in order).
    """
    job_t = _q(Job._meta.db_table)
    # Rows of a table's own shape are read by its row type (jsonb_populate_recordset):
    # no column list, which keeps the text under psycopg's 4 KiB parse cache.
    artifact_t, effect_t = _q(Artifact._meta.db_table), _q(Effect._meta.db_table)
    user = get_user_model()
    pk = user._meta.pk
    admits = rules.to_sql(rules.account_admits(user), user, alias="u", quote=_q)
    fence = rules.to_sql(rules.OWNER_FENCE, Job, quote=_q)
    sets = ["version = version + 1", f"updated_at = {NOW}"]
    for name, clock in changes:
        sets.append(f"{_q(Job._meta.get_field(name).column)} = {NOW if clock else '%s'}")

    def cols(model, prefix="v."):
        return ", ".join(prefix + _q(f.column) for f in _fields(model))

    def names(model):
        return ", ".join(_q(f.column) for f in _fields(model))

    ref = f"'{rules.NOTICE_REF_PREFIX}' || n.id"
    effect_picks = ", ".join(
        f"COALESCE({ref}, v.provider_ref)" if f.column == "provider_ref" else f"v.{_q(f.column)}"
        for f in _fields(Effect)
    )
    text = _compact(f"""
        WITH refused AS (
            SELECT r.id, CASE WHEN u.{_q(pk.column)} IS NULL THEN 'missing' ELSE 'refused' END
                AS why
            FROM jsonb_array_elements_text(%s::jsonb) AS r(id)
            LEFT JOIN {_q(user._meta.db_table)} u
                   ON u.{_q(pk.column)} = r.id::{pk.cast_db_type(connection)}
            WHERE u.{_q(pk.column)} IS NULL OR NOT {admits.text}
        ), locked AS (
            SELECT id FROM {job_t} WHERE id = %s FOR UPDATE NOWAIT
        ), job AS (
            UPDATE {job_t} SET {", ".join(sets)}
            WHERE id = (SELECT id FROM locked) AND {fence.text}
              AND NOT EXISTS (SELECT 1 FROM refused)
            RETURNING id
        ), attempt AS (
            UPDATE {_q(Attempt._meta.db_table)} SET outcome = %s, finished_at = {NOW}
            WHERE id = %s AND EXISTS (SELECT 1 FROM job)
            RETURNING id
        ), artifact AS (
            INSERT INTO {artifact_t} (job_id, {names(Artifact)})
            SELECT job.id, {cols(Artifact)}
            FROM job, jsonb_populate_recordset(NULL::{artifact_t}, %s::jsonb) AS v
            RETURNING id
        ), notice_row AS MATERIALIZED (
            SELECT v.*, nextval(pg_get_serial_sequence('{Notice._meta.db_table}', 'id')) AS id
            FROM job, jsonb_to_recordset(%s::jsonb) AS v({_record_type(Notice, key=True)})
        ), effect AS (
            INSERT INTO {effect_t} (job_id, {names(Effect)})
            SELECT job.id, {effect_picks}
            FROM job, jsonb_populate_recordset(NULL::{effect_t}, %s::jsonb) AS v
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
        SELECT (SELECT count(*) FROM job), (SELECT json_object_agg(id, why) FROM refused),
               (SELECT id FROM artifact),
               (SELECT json_object_agg(effect_id, id) FROM effect),
               (SELECT json_object_agg(_key, id) FROM notice_row)
    """)
    return text, (admits, fence)


def publish(plan: Plan) -> Result:
    """Carry out ``plan`` in one statement where it can, else by the ORM executor.

    The ORM takes a plan the statement cannot (``Plan.statement_refusal``) and one the
    statement gave way on (``jobs.engine.refusals``: the job's row locked elsewhere, a
    recipient deleted mid-publish). A lost connection is an error, not a refusal.
    """
    if not plan.statement_refusal():
        try:
            with transaction.atomic() if connection.in_atomic_block else nullcontext():
                result = _publish_in_one(plan)
        except DatabaseError as exc:
            why = refusal(exc)
            if why is None:
                raise
            log.info("job=%s one-statement publish gave way (%s): ORM path", plan.job.pk, why)
        else:
            if result.status == Status.WON:
                job_machine.mirror_publish(plan.job, plan.worker)
                plan.attempt.outcome = Attempt.Outcome.SUCCEEDED
                effect_machine.log_born(plan.effects, plan.worker)
                result.effects = list(plan.effects)
            return result
    return orm.publish(plan)


def _publish_in_one(plan: Plan) -> Result:
    """running → succeeded with the attempt's outcome, the artifact row, the effects born
    final, their notices and events, in one statement.

    The account rule is checked for ``plan.accounts`` in the same statement; if it
    refuses one, nothing is written and the result names them. If the owner fence
    fails, nothing is written. On a win the plan's instances get their ids.
    """
    job = plan.job
    changes = dict(plan.changes)
    statement, (admits, fence) = _publish_statement(
        tuple((k, isinstance(v, Now)) for k, v in changes.items())
    )
    params = [json.dumps(list(plan.accounts)), *admits.params(), _int8(job.pk)]
    params += [v for v in changes.values() if not isinstance(v, Now)]
    params += fence.params(
        job=_int8(job.pk), version=_int8(job.version), worker=plan.worker, margin=plan.margin
    )
    params += [Attempt.Outcome.SUCCEEDED, _int8(plan.attempt.pk)]
    params.append(_rows_json(Artifact, [plan.artifact] if plan.artifact is not None else []))
    params.append(_keyed_json(Notice, plan.notices))
    params.append(_rows_json(Effect, list(plan.effects)))
    params.append(_keyed_json(EffectEvent, plan.events))
    with _cursor() as cursor:
        cursor.execute(statement, params)
        won, refused, artifact_id, effect_ids, notice_ids = cursor.fetchone()
    if not won:
        if refused:
            why = {"missing": rules.ACCOUNT_MISSING, "refused": rules.ACCOUNT_REFUSED}
            reasons = {str(k): why[v] for k, v in _json(refused).items()}
            return Result(Status.ACCOUNTS_REFUSED, name, reasons)
        return Result(Status.LOST, name)
    if plan.artifact is not None:
        plan.artifact.pk = artifact_id
        plan.artifact._state.adding = False
    effect_ids, notice_ids = _json(effect_ids), _json(notice_ids)
    for effect in plan.effects:
        effect.pk = effect_ids[effect.effect_id]
        effect._state.adding = False
        if effect.effect_id in notice_ids:
            effect.provider_ref = rules.notice_reference(notice_ids[effect.effect_id])
    return Result(Status.WON, name)


def _compact(statement: str) -> str:
    """One line, single spaces: under 4 KiB psycopg keeps the parsed statement too."""
    return " ".join(statement.split())


def _json(value) -> dict:
    if value is None:
        return {}
    return json.loads(value) if isinstance(value, str) else dict(value)
