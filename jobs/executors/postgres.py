"""The PostgreSQL executor: the claim and the publish as one hand-written statement each.

Everything else in the engine speaks the ORM. The publish runs once per job, and the
ORM would need eight round trips for it; here it is one statement in autocommit, so
it is also one transaction and one commit. Every condition of the ORM's
compare-and-swap is kept (version, owner, a live lease by the server's clock); a
statement that matches no row changes nothing. The next-job claim, where the jobs
table is the queue, is one statement too (``jobs.executors.pgclaim``, which uses this
module's cursor and row reading); the claim of one named job is the engine's
(``jobs.engine.named_claim``), whose admission is the same function
(``jobs_flow_verdict_v1``, migration 0021).

Fences read ``clock_timestamp()``, not the statement's start: a statement that
waited for a lock judges the lease by the time it actually writes. The publish
never waits for the job's row (``FOR UPDATE NOWAIT``): if another transaction holds
it, the statement fails at once and the engine's ORM publish
(``jobs.engine.publishing``), whose transaction carries the lock timeout
(``clock.worker_transaction``), publishes instead. Being one statement in
autocommit, it cannot be left idle in a transaction by a frozen worker: the server
commits it, or nothing, by itself.

Their conditions are not spelled here: the owner fence, the live lease and the
account release rule come from ``jobs.rules``, which renders the same definitions for
the ORM. The publish carries out a ``jobs.engine.plan.Plan``; the ORM publish carries
out the same plan for the documented refusals: a plan with effects that need a
provider's own code, the job's row locked elsewhere, a recipient deleted
mid-publish. psycopg is imported only when a statement runs: a site on SQLite or
psycopg2 never loads it. This module never imports the ORM executor.
"""

from __future__ import annotations

import functools
import json
import logging
from contextlib import nullcontext
from datetime import datetime

from django.contrib.auth import get_user_model
from django.db import (
    DatabaseError,
    connection,
    models,
    transaction,
)
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now

from jobs import queue, rules
from jobs.engine import effect_machine, job_machine, named_claim, publishing
from jobs.engine.plan import Claim, Plan, Result, Status
from jobs.engine.refusals import refusal
from jobs.executors import pgclaim
from jobs.executors.pgsql import NOW, _compact, _cursor, _int8, _json, _q, _tight
from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, JobStep, Notice

log = logging.getLogger("jobs.executors")

name = "postgres"


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


# --- claim ---------------------------------------------------------------------------


def read_claim(job_id: int, attempt_id: int) -> Attempt | None:
    """The attempt a claim started, with its job and the server's clock, in one read."""
    return pgclaim.read_claim(job_id, attempt_id)


def claim(job_id: int, worker: str, *, lease: float, bound: int) -> Claim:
    """The claim of one named job (``jobs.engine.named_claim``: exactly that job, or why
    not), the same on every database; a cluster's dequeue is ``pgclaim.claim_next``."""
    return named_claim.claim(job_id, worker, lease=lease, bound=bound)


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


_SKIP = {
    Artifact: "job_id",
    Effect: "job_id",
    Notice: "effect_id",
    EffectEvent: "effect_id",
    JobStep: "job_id",
}


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
            elif model is Effect and attname == "next_attempt_at" and isinstance(value, Now):
                value = None  # due now: the statement writes its own clock (``due_now``)
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


def _cols(model: type[models.Model], prefix: str = "v.") -> str:
    """A model's written columns as ``prefix``-ed references, in ``_fields`` order."""
    return ", ".join(prefix + _q(f.column) for f in _fields(model))


def _names(model: type[models.Model]) -> str:
    """A model's written columns, in ``_fields`` order."""
    return ", ".join(_q(f.column) for f in _fields(model))


def _steps_insert() -> str:
    """The publish's insert of the durable steps that rode on it (``jobs.delivery.steps``)."""
    step_t = _q(JobStep._meta.db_table)
    return (
        f"INSERT INTO {step_t} (job_id, {_names(JobStep)}) SELECT job.id, {_cols(JobStep)} "
        f"FROM job, jsonb_populate_recordset(NULL::{step_t}, %s::jsonb) AS v "
        "ON CONFLICT DO NOTHING"
    )


@functools.cache
def _publish_statement(
    changes: tuple[tuple[str, bool], ...], sequenced: bool = False
) -> tuple[str, tuple]:
    """The publish, one text for every job (so the server plans it once per connection).

    ``changes``: ``(field name, is the server's clock)`` of the job's publish columns.
    ``sequenced``: it also releases its sequence's next job when this one lets it start
    (``pgclaim.next_release_sql``; longer, tightened within psycopg's 4 KiB parse cache).
    Returns the text and the rendered rules it embeds (their parameters, in order).
    """
    release, released = pgclaim.next_release_sql() if sequenced else ("", "NULL")
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
    ref = f"'{rules.NOTICE_REF_PREFIX}' || n.id"
    # A pending effect is due now by the server's clock (its row's ``Now()``, which JSON
    # cannot carry: written as null, the statement's clock is put in).
    due_now = f"CASE WHEN v.state = 'pending' THEN COALESCE(v.next_attempt_at, {NOW}) END"
    picks = {"provider_ref": f"COALESCE({ref}, v.provider_ref)", "next_attempt_at": due_now}
    effect_picks = ", ".join(picks.get(f.column, f"v.{_q(f.column)}") for f in _fields(Effect))
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
            INSERT INTO {artifact_t} (job_id, {_names(Artifact)})
            SELECT job.id, {_cols(Artifact)}
            FROM job, jsonb_populate_recordset(NULL::{artifact_t}, %s::jsonb) AS v
            RETURNING id
        ), notice_row AS MATERIALIZED (
            SELECT v.*, nextval(pg_get_serial_sequence('{Notice._meta.db_table}', 'id')) AS id
            FROM job, jsonb_to_recordset(%s::jsonb) AS v({_record_type(Notice, key=True)})
        ), effect AS (
            INSERT INTO {effect_t} (job_id, {_names(Effect)})
            SELECT job.id, {effect_picks}
            FROM job, jsonb_populate_recordset(NULL::{effect_t}, %s::jsonb) AS v
            LEFT JOIN notice_row n ON n._key = v.effect_id
            RETURNING id, effect_id
        ), notice AS (
            INSERT INTO {_q(Notice._meta.db_table)} (id, effect_id, {_names(Notice)})
            SELECT n.id, e.id, {_cols(Notice, "n.")}
            FROM notice_row n JOIN effect e ON e.effect_id = n._key
            RETURNING effect_id, id
        ), event AS (
            INSERT INTO {_q(EffectEvent._meta.db_table)} (effect_id, {_names(EffectEvent)})
            SELECT e.id, {_cols(EffectEvent)}
            FROM jsonb_to_recordset(%s::jsonb) AS v({_record_type(EffectEvent, key=True)})
            JOIN effect e ON e.effect_id = v._key
            RETURNING id
        ), step AS ({_steps_insert()}){release}
        SELECT (SELECT count(*) FROM job), (SELECT json_object_agg(id, why) FROM refused),
               (SELECT id FROM artifact),
               (SELECT json_object_agg(effect_id, id) FROM effect),
               (SELECT json_object_agg(_key, id) FROM notice_row),
               (SELECT pg_notify(%s, '') FROM job WHERE %s), {released}
    """)
    return (_tight(text) if sequenced else text), (admits, fence)


@functools.cache
def _release_channel() -> str:
    """The channel of the default queue's clusters, which send the effects."""
    return queue.channel_of(rules.DEFAULT_QUEUE)


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
    return publishing.publish(plan)


def _publish_in_one(plan: Plan) -> Result:
    """running → succeeded with the attempt's outcome, the artifact row, the effects born
    final, their notices and events, in one statement.

    The account rule is checked for ``plan.accounts`` in the same statement; if it
    refuses one, nothing is written and the result names them. If the owner fence
    fails, nothing is written. On a win the plan's instances get their ids.
    """
    job = plan.job
    changes = dict(plan.changes)
    # A sequenced job whose effects all settle here releases its key's next job in this
    # statement; one with an effect left to a sender lets it go when that send settles.
    unsettled = rules.EFFECT_UNSETTLED
    sequenced = bool(job.sequence_key) and not any(
        rules.holds(unsettled, e, now=None) for e in plan.effects
    )
    statement, (admits, fence) = _publish_statement(
        tuple((k, isinstance(v, Now)) for k, v in changes.items()), sequenced
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
    params.append(_rows_json(JobStep, list(plan.steps)))
    if sequenced:
        # No NOTIFY when this worker's cluster claims the queue's next job as soon as
        # this delivery ends: it starts the released job itself.
        release_params, column_params = pgclaim.next_release_params(
            job, channel=queue.channel_of(job.queue), wake=not queue.claimed_next_here(job.queue)
        )
        params += release_params
    # Effects left to a sender: the default queue's clusters are woken when this commits.
    params += [_release_channel(), bool(plan.enqueues)]
    if sequenced:
        params += column_params
    with _cursor() as cursor:
        cursor.execute(statement, params)
        won, refused, artifact_id, effect_ids, notice_ids, _woken, released = cursor.fetchone()
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
    pgclaim.log_released(released)
    if released and queue.channel_of(released[2]) != queue.channel_of(job.queue):
        queue.notify_queues([released[2]])  # the statement woke the job's own queue only
    return Result(Status.WON, name, sequence_looked=bool(job.sequence_key))
