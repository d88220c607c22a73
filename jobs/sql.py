"""The hot path's two statements, hand-written: the claim and the publish (PostgreSQL).

Everything else in the engine speaks the ORM. These two run once per job, and the
ORM would need five round trips for the claim and eight for the publish; each here
is one statement in autocommit, so it is also one transaction and one commit.
Every condition of the ORM's compare-and-swap is kept (version, owner, a live
lease by the server's clock, due time, attempt budget, tenant bound); a statement
that matches no row changes nothing, and the caller falls back to the ORM path,
which records why (duplicate, deferred, buried).

Fences read ``clock_timestamp()``, not the statement's start: a statement that
waited for a lock judges the lease by the time it actually writes.

SQLite and custom transactional providers take the ORM path (``transitions``,
``ledger.record``); the ``jobs_tenant_admits`` function comes from migration 0007.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from django.db import connection, models
from django.db.models.functions import Now

from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, Notice

NOW = "clock_timestamp()"


def available() -> bool:
    """Whether the one-statement paths apply to the default connection."""
    return connection.vendor == "postgresql"


def _q(name: str) -> str:
    return f'"{name}"'  # PostgreSQL's quoting; names come from models, never from input


# --- claim ----------------------------------------------------------------------------


def claim(job_id: int, worker: str, *, lease: float, bound: int):
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
              AND (tenant_key = '' OR jobs_tenant_admits(tenant_key, id, %s))
            RETURNING {columns}
        ), attempt AS (
            INSERT INTO {attempt_t}
                (job_id, number, worker, started_at, outcome, error_class, error_code)
            SELECT id, attempts, %s, {NOW}, '', '', '' FROM claimed
            RETURNING id, started_at
        )
        SELECT claimed.*, attempt.id AS claim_attempt_id, attempt.started_at AS db_now
        FROM claimed CROSS JOIN attempt
    """
    params = [S.RUNNING, worker, float(lease), job_id, S.QUEUED, S.RETRY_WAIT, bound]
    rows = list(Job.objects.raw(sql, [*params, worker]))
    if not rows:
        return None
    job = rows[0]
    attempt = Attempt(
        pk=job.claim_attempt_id,
        job=job,
        number=job.attempts,
        worker=worker,
        started_at=job.db_now,
    )
    attempt._state.adding, attempt._state.db = False, job._state.db
    return job, attempt


# --- publish --------------------------------------------------------------------------


@dataclass
class Published:
    artifact_id: int | None = None
    effect_ids: dict[str, int] = field(default_factory=dict)  # effect_id → pk
    notice_ids: dict[str, int] = field(default_factory=dict)  # effect_id → notice pk


@functools.cache
def _columns(model: type[models.Model], skip: tuple[str, ...]) -> tuple[tuple, ...]:
    """``(field, column, cast)`` of the columns an insert of ``model`` writes (PostgreSQL)."""
    return tuple(
        (f, f.column, f.cast_db_type(connection))
        for f in model._meta.concrete_fields
        if not f.primary_key and f.attname not in skip
    )


def _values(model: type[models.Model], objs: list, *, skip: tuple[str, ...] = (), key=None):
    """``(columns, VALUES list, params)`` for unsaved instances, each cell cast to its type.

    ``key``: a function giving each row a text key, as the first column ``_key``,
    to join rows of one CTE to the ids another returns.
    """
    fields = _columns(model, skip)
    rows, params = [], []
    for obj in objs:
        cells = []
        if key is not None:
            cells.append("%s::text")
            params.append(key(obj))
        for f, _column, cast in fields:
            value = getattr(obj, f.attname)
            if isinstance(value, Now):
                cells.append(NOW)
                continue
            cells.append(f"%s::{cast}")
            params.append(f.get_db_prep_save(value, connection))
        rows.append(f"({', '.join(cells)})")
    columns = ([] if key is None else ["_key"]) + [column for _f, column, _cast in fields]
    return columns, "VALUES " + ", ".join(rows), params


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
) -> Published | None:
    """running → succeeded with everything that commits with it, in one statement.

    ``changes``: the job's publish columns (``transitions.publish_changes``). The
    effects are born in their final state (applied or withheld); ``notices`` and
    ``events`` name their effect by ``effect.effect_id`` (unsaved, no pk yet). The
    attempt's outcome is written only if the CAS won. None when it lost.
    """
    job_t = _q(Job._meta.db_table)
    sets, params = ["version = version + 1", f"updated_at = {NOW}"], []
    for name, value in changes.items():
        column = _q(Job._meta.get_field(name).column)
        if isinstance(value, Now):
            sets.append(f"{column} = {NOW}")
        else:
            sets.append(f"{column} = %s")
            params.append(value)
    ctes = [
        f"""job AS (
            UPDATE {job_t} SET {", ".join(sets)}
            WHERE id = %s AND version = %s AND lease_owner = %s
              AND lease_expires_at > {NOW} + make_interval(secs => %s)
            RETURNING id)"""
    ]
    params += [job.pk, job.version, worker, float(margin)]
    ctes.append(
        f"""attempt AS (
            UPDATE {_q(Attempt._meta.db_table)} SET outcome = %s, finished_at = {NOW}
            WHERE id = %s AND EXISTS (SELECT 1 FROM job) RETURNING id)"""
    )
    params += [Attempt.Outcome.SUCCEEDED, attempt_id]
    selects = ["(SELECT count(*) FROM job)", "(SELECT count(*) FROM attempt)"]

    if artifact is not None:
        cols, values, p = _values(Artifact, [artifact], skip=("job_id",))
        ctes.append(
            f"""artifact AS (
                INSERT INTO {_q(Artifact._meta.db_table)} (job_id, {", ".join(cols)})
                SELECT job.id, v.* FROM job, ({values}) AS v({", ".join(cols)})
                ON CONFLICT (key) DO NOTHING RETURNING id)"""
        )
        params += p
        selects.append("(SELECT id FROM artifact)")
    else:
        selects.append("NULL")

    if effects:
        # Notice ids are drawn first: the in-app provider's reference names its notice.
        by_effect = {n.effect_key: n for n in notices}
        for e in effects:
            if e.effect_id in by_effect:
                e.provider_ref = ""  # filled from the drawn id below
        notice_t = Notice._meta.db_table
        ncols, nvalues, np_ = _values(
            Notice, notices, skip=("effect_id",), key=lambda n: n.effect_key
        )
        ecols, evalues, ep = _values(Effect, effects, skip=("job_id",), key=lambda e: e.effect_id)
        if notices:
            ctes.append(
                f"""notice_id AS MATERIALIZED (
                    SELECT v._key, nextval(pg_get_serial_sequence(%s, 'id')) AS id
                    FROM ({nvalues}) AS v({", ".join(ncols)}))"""
            )
            params += [notice_t, *np_]
            ref = "COALESCE('notice:' || notice_id.id, v.provider_ref)"
            join = "LEFT JOIN notice_id ON notice_id._key = v._key"
        else:
            ref, join = "v.provider_ref", ""
        effect_cols = [c for c in ecols if c != "_key"]
        picks = ", ".join(ref if c == "provider_ref" else f"v.{_q(c)}" for c in effect_cols)
        ctes.append(
            f"""effect AS (
                INSERT INTO {_q(Effect._meta.db_table)} (job_id, {", ".join(map(_q, effect_cols))})
                SELECT job.id, {picks}
                FROM job, ({evalues}) AS v({", ".join(ecols)}) {join}
                RETURNING id, effect_id)"""
        )
        params += ep
        selects.append("(SELECT json_object_agg(effect_id, id) FROM effect)")
        if notices:
            ctes.append(
                f"""notice AS (
                    INSERT INTO {_q(notice_t)} (id, effect_id, {", ".join(map(_q, ncols[1:]))})
                    SELECT notice_id.id, effect.id, {", ".join(f"v.{_q(c)}" for c in ncols[1:])}
                    FROM ({nvalues}) AS v({", ".join(ncols)})
                    JOIN notice_id ON notice_id._key = v._key
                    JOIN effect ON effect.effect_id = v._key
                    RETURNING effect_id, id)"""
            )
            params += np_
            selects.append("(SELECT json_object_agg(effect_id, id) FROM notice)")
        if events:
            vcols, vvalues, vp = _values(
                EffectEvent, events, skip=("effect_id",), key=lambda ev: ev.effect_key
            )
            ctes.append(
                f"""event AS (
                    INSERT INTO {_q(EffectEvent._meta.db_table)}
                        (effect_id, {", ".join(map(_q, vcols[1:]))})
                    SELECT effect.id, {", ".join(f"v.{_q(c)}" for c in vcols[1:])}
                    FROM ({vvalues}) AS v({", ".join(vcols)})
                    JOIN effect ON effect.effect_id = v._key
                    RETURNING id)"""
            )
            params += vp
            selects.append("(SELECT count(*) FROM event)")

    statement = "WITH " + ",\n".join(ctes) + "\nSELECT " + ", ".join(selects)
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        row = cursor.fetchone()
    if not row[0]:
        return None
    out = Published(artifact_id=row[2])
    if effects:
        out.effect_ids = _json(row[3])
        if notices:
            out.notice_ids = _json(row[4])
    return out


def _json(value) -> dict:
    if value is None:
        return {}
    return json.loads(value) if isinstance(value, str) else dict(value)
