"""The admission of ``jobs.engine.admission.admit`` as one PostgreSQL function.

``jobs_flow_verdict_v1`` is the only admission on PostgreSQL: the next-job claim
(``jobs.executors.pgclaim``) calls it in its statement after it has locked the job's row,
and every other claim on PostgreSQL calls it through ``admission.admit``. It answers
with a verdict, never a bare no: ``(scope, reason, delay)``, reason ``''`` when the job
may start. The claim records a refusal as it is (a deferral of ``delay`` seconds), so
nothing decides about the job a second time.

The same procedure as the ORM's ``admit``, in the same order: pause (kind, tenant,
queue); the kind's concurrency; the tenant's (its row's bound, else ``p_bound``, the
setting; without any flow rule the plain tenant bound, ``tenant_bound``); the queue's;
then the rates, last and all-or-nothing. Scope locks are waited for (never tried and
given up: a lock is held for one claim statement, and every claim takes them in the
same order, kind, tenant, queue, then the rated rows by id). The text is generated
here and frozen in migration 0021; ``tests/jobs/test_rules.py`` fails if they drift.
"""

from __future__ import annotations

from jobs import rules
from jobs.models import FlowRule, Job

TYPE_NAME = "jobs_verdict_v1"
FUNCTION_NAME = "jobs_flow_verdict_v1"
# v2 (migration 0033): a concurrency hold comes back within one second (a slot frees when
# any running job ends), never spread over a rate's period: with a rate of 6/h that put
# it up to an hour away although the rule allowed its next start ten minutes later.
FUNCTION_NAME_V2 = "jobs_flow_verdict_v2"
VERSIONS = {1: FUNCTION_NAME, 2: FUNCTION_NAME_V2}


def verdict_type_sql() -> str:
    return f"CREATE TYPE {TYPE_NAME} AS (scope varchar, reason varchar, delay float8);"


_TABLE = FlowRule._meta.db_table
_PAUSED_DELAY = "p_paused_delay * (1 + random())"
_TENANT_DELAY = "p_tenant_delay * (1 + random())"
_TENANT_SCOPE = f"'{rules.FLOW_TENANT_PREFIX}' || p_tenant"
_RATED = "r.id IN (k.id, t.id, q.id) AND r.rate > 0"


def _active(alias: str) -> str:
    text = rules.literal_sql(rules.FLOW_RULE_ACTIVE, FlowRule, alias=alias, quote=lambda n: n)
    return f"COALESCE({text}, false)"


def _spread(alias: str, version: int) -> str:
    if version >= 2:
        return "random()"  # ``admission.spread``: up to one second
    # v1: over one period (a rate's) or up to one second.
    period = f"CASE WHEN COALESCE({alias}.rate, 0) > 0 THEN {alias}.period_seconds ELSE 1.0 END"
    return f"random() * {period}"


def _hold(scope: str, reason: str, delay: str) -> str:
    return f"RETURN ROW({scope}, '{reason}', {delay})::{TYPE_NAME};"


def _paused(alias: str) -> str:
    return f"""    IF COALESCE({alias}.paused, false) THEN
        {_hold(f"{alias}.scope", "paused", _PAUSED_DELAY)}
    END IF;"""


def _counted(where: str) -> str:
    live = rules.literal_sql(rules.LIVE_RUNNING, Job, quote=lambda n: n)
    return f"(SELECT count(*) FROM {Job._meta.db_table} WHERE {where} AND {live} AND id <> p_job)"


def _concurrency(
    alias: str, where: str, lock_class: int, key: str, bound: str, scope: str, version: int
) -> str:
    """A scope's concurrency: its lock waited for, then the live running jobs counted."""
    return f"""        PERFORM pg_advisory_xact_lock({lock_class}, hashtext({key}));
        IF {_counted(where)} >= {bound} THEN
            {_hold(scope, "concurrency", "0.2 + " + _spread(alias, version))}
        END IF;"""


def _rates() -> str:
    """The rates, last and all-or-nothing: the rated rows locked in id order, every one
    judged, and a start taken from each only if all allow one."""
    due = rules.GCRA_DUE_SQL.format(r="r.", now="v_now")
    take = rules.GCRA_NEXT_SQL.format(r="r.", now="v_now")
    any_rate = " OR ".join(f"COALESCE({a}.rate, 0) > 0" for a in "ktq")
    return f"""    IF {any_rate} THEN
        PERFORM 1 FROM {_TABLE} r WHERE {_RATED} ORDER BY r.id FOR UPDATE;
        v_now := clock_timestamp();
        SELECT r.scope, r.paused, EXTRACT(EPOCH FROM (r.next_free_at - v_now)),
            r.period_seconds / r.rate
        INTO v_scope, v_paused, v_ahead, v_interval
        FROM {_TABLE} r WHERE {_RATED} AND (r.paused OR NOT {due})
        ORDER BY r.paused DESC, CASE r.id WHEN k.id THEN 0 WHEN t.id THEN 1 ELSE 2 END
        LIMIT 1;
        IF FOUND AND v_paused THEN
            {_hold("v_scope", "paused", _PAUSED_DELAY)}
        ELSIF FOUND THEN
            {_hold("v_scope", "rate", "GREATEST(v_ahead, 0) + random() * v_interval")}
        END IF;
        UPDATE {_TABLE} r SET next_free_at = {take} WHERE {_RATED};
    END IF;"""


def verdict_function_sql(version: int = 1) -> str:
    """The function's text (``CREATE OR REPLACE``), from ``jobs.rules``'s conditions:
    ``jobs_flow_verdict_v1`` (migration 0021) or ``_v2`` (migration 0033)."""
    tenant_lock, flow_lock = rules.TENANT_LOCK_CLASS, rules.FLOW_LOCK_CLASS
    kind = _concurrency(
        "k", "kind = p_kind", flow_lock, "k.scope", "k.concurrency", "k.scope", version
    )
    tenant = _concurrency(
        "t",
        "tenant_key = p_tenant",
        tenant_lock,
        "p_tenant",
        "COALESCE(t.concurrency, p_bound)",
        _TENANT_SCOPE,
        version,
    )
    queue = _concurrency(
        "q", "queue = p_queue", flow_lock, "q.scope", "q.concurrency", "q.scope", version
    )
    return f"""
CREATE OR REPLACE FUNCTION {VERSIONS[version]}(
    p_kind varchar, p_tenant varchar, p_queue varchar, p_job bigint, p_bound integer,
    p_paused_delay float8, p_tenant_delay float8
) RETURNS {TYPE_NAME} LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    k record;
    t record;
    q record;
    v_ruled boolean;
    v_now timestamptz;
    v_scope varchar;
    v_paused boolean;
    v_ahead float8;
    v_interval float8;
BEGIN
    SELECT * INTO k FROM {_TABLE} WHERE scope = '{rules.FLOW_KIND_PREFIX}' || p_kind;
    SELECT * INTO t FROM {_TABLE} WHERE p_tenant <> '' AND scope = {_TENANT_SCOPE};
    SELECT * INTO q FROM {_TABLE} WHERE scope = '{rules.FLOW_QUEUE_PREFIX}' || p_queue;
    v_ruled := {_active("k")} OR {_active("t")} OR {_active("q")};
    IF NOT v_ruled THEN
        IF p_tenant = '' THEN
            RETURN ROW('', '', 0)::{TYPE_NAME};
        END IF;
        PERFORM pg_advisory_xact_lock({tenant_lock}, hashtext(p_tenant));
        IF {_counted("tenant_key = p_tenant")} >= p_bound THEN
            {_hold(_TENANT_SCOPE, "tenant_bound", _TENANT_DELAY)}
        END IF;
        RETURN ROW('', '', 0)::{TYPE_NAME};
    END IF;
{_paused("k")}
{_paused("t")}
{_paused("q")}
    IF k.concurrency IS NOT NULL THEN
{kind}
    END IF;
    IF p_tenant <> '' THEN
{tenant}
    END IF;
    IF q.concurrency IS NOT NULL THEN
{queue}
    END IF;
{_rates()}
    RETURN ROW('', '', 0)::{TYPE_NAME};
END $$;
"""


DROP = f"DROP FUNCTION IF EXISTS {FUNCTION_NAME}; DROP TYPE IF EXISTS {TYPE_NAME};"
