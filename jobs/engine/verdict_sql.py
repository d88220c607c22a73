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


def verdict_type_sql() -> str:
    return f"CREATE TYPE {TYPE_NAME} AS (scope varchar, reason varchar, delay float8);"


def verdict_function_sql() -> str:
    """The function's text (``CREATE OR REPLACE``), from ``jobs.rules``'s conditions."""
    table = FlowRule._meta.db_table
    job_table = Job._meta.db_table
    live = rules.literal_sql(rules.LIVE_RUNNING, Job, quote=lambda n: n)
    due = rules.GCRA_DUE_SQL.format(r="r.", now="v_now")
    take = rules.GCRA_NEXT_SQL.format(r="r.", now="v_now")
    rated = "r.id IN (k.id, t.id, q.id) AND r.rate > 0"

    def active(alias: str) -> str:
        text = rules.literal_sql(rules.FLOW_RULE_ACTIVE, FlowRule, alias=alias, quote=lambda n: n)
        return f"COALESCE({text}, false)"

    def spread(alias: str) -> str:
        # ``admission.spread``: over one period (a rate's) or up to one second.
        period = f"CASE WHEN COALESCE({alias}.rate, 0) > 0 THEN {alias}.period_seconds ELSE 1.0 END"
        return f"random() * {period}"

    def hold(scope: str, reason: str, delay: str) -> str:
        return f"RETURN ROW({scope}, '{reason}', {delay})::{TYPE_NAME};"

    paused_delay = "p_paused_delay * (1 + random())"
    tenant_delay = "p_tenant_delay * (1 + random())"
    tenant_scope = f"'{rules.FLOW_TENANT_PREFIX}' || p_tenant"

    def paused(alias: str) -> str:
        return f"""    IF COALESCE({alias}.paused, false) THEN
        {hold(f"{alias}.scope", "paused", paused_delay)}
    END IF;"""

    def counted(where: str) -> str:
        return f"(SELECT count(*) FROM {job_table} WHERE {where} AND {live} AND id <> p_job)"

    return f"""
CREATE OR REPLACE FUNCTION {FUNCTION_NAME}(
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
    v_period float8;
BEGIN
    SELECT * INTO k FROM {table} WHERE scope = '{rules.FLOW_KIND_PREFIX}' || p_kind;
    SELECT * INTO t FROM {table} WHERE p_tenant <> '' AND scope = {tenant_scope};
    SELECT * INTO q FROM {table} WHERE scope = '{rules.FLOW_QUEUE_PREFIX}' || p_queue;
    v_ruled := {active("k")} OR {active("t")} OR {active("q")};
    IF NOT v_ruled THEN
        IF p_tenant = '' THEN
            RETURN ROW('', '', 0)::{TYPE_NAME};
        END IF;
        PERFORM pg_advisory_xact_lock({rules.TENANT_LOCK_CLASS}, hashtext(p_tenant));
        IF {counted("tenant_key = p_tenant")} >= p_bound THEN
            {hold(tenant_scope, "tenant_bound", tenant_delay)}
        END IF;
        RETURN ROW('', '', 0)::{TYPE_NAME};
    END IF;
{paused("k")}
{paused("t")}
{paused("q")}
    IF k.concurrency IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock({rules.FLOW_LOCK_CLASS}, hashtext(k.scope));
        IF {counted("kind = p_kind")} >= k.concurrency THEN
            {hold("k.scope", "concurrency", "0.2 + " + spread("k"))}
        END IF;
    END IF;
    IF p_tenant <> '' THEN
        PERFORM pg_advisory_xact_lock({rules.TENANT_LOCK_CLASS}, hashtext(p_tenant));
        IF {counted("tenant_key = p_tenant")} >= COALESCE(t.concurrency, p_bound) THEN
            {hold(tenant_scope, "concurrency", "0.2 + " + spread("t"))}
        END IF;
    END IF;
    IF q.concurrency IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock({rules.FLOW_LOCK_CLASS}, hashtext(q.scope));
        IF {counted("queue = p_queue")} >= q.concurrency THEN
            {hold("q.scope", "concurrency", "0.2 + " + spread("q"))}
        END IF;
    END IF;
    IF COALESCE(k.rate, 0) > 0 OR COALESCE(t.rate, 0) > 0 OR COALESCE(q.rate, 0) > 0 THEN
        PERFORM 1 FROM {table} r WHERE {rated} ORDER BY r.id FOR UPDATE;
        v_now := clock_timestamp();
        SELECT r.scope, r.paused, EXTRACT(EPOCH FROM (r.next_free_at - v_now)), r.period_seconds
        INTO v_scope, v_paused, v_ahead, v_period
        FROM {table} r WHERE {rated} AND (r.paused OR NOT {due})
        ORDER BY r.paused DESC, CASE r.id WHEN k.id THEN 0 WHEN t.id THEN 1 ELSE 2 END
        LIMIT 1;
        IF FOUND AND v_paused THEN
            {hold("v_scope", "paused", paused_delay)}
        ELSIF FOUND THEN
            {hold("v_scope", "rate", "GREATEST(v_ahead, 0) + random() * v_period")}
        END IF;
        UPDATE {table} r SET next_free_at = {take} WHERE {rated};
    END IF;
    RETURN ROW('', '', 0)::{TYPE_NAME};
END $$;
"""


DROP = f"DROP FUNCTION IF EXISTS {FUNCTION_NAME}; DROP TYPE IF EXISTS {TYPE_NAME};"
