"""Weighted fair share across tenants inside the next-job claim (docs/app/fairness.md).

Start-time fair queueing over ``tenant_key``, per queue. Each tenant has a row
(``jobs.models.TenantShare``) with the virtual start tag of its last claim and its
finish tag (start + 1 / weight). The queue's virtual time ``V`` is the largest start tag handed
out. A new tenant's first start tag is ``V``; a known tenant's next one is ``max(finish,
V - LAG)``: a tenant back from idle saved at most ``LAG`` of credit, a busy one starts at
its finish tag.

The claim's order, the same on both executors:

1. the candidates: each waiting tenant's head (its best job by priority, then due
   time) and the queue's longest-waiting job (which keeps the aging bound across
   priority bands, docs/app/scheduling.md);
2. the band: the declared priority of the candidate with the highest effective
   priority (the order the claim had without fairness);
3. within the band, by (tenant at its concurrency bound last, start tag, due time,
   id); the job taken is that tenant's longest-waiting job of the band.

A claim that starts a job charges its tenant: ``start = max(finish, V - LAG)``, ``finish =
start + 1 / weight``, in the claim's transaction. Weights are flow rules
(``tenant:<key> --weight N``; ``tenant:*`` the default; else ``JOBS_TENANT_WEIGHT``);
a weight holds nothing back, so alone a tenant may use every slot (work-conserving).

The order and the charge matter only while two tenants wait: with fewer, the fair order
is the plain claim's (a lone tenant's turn is its best job by effective priority), so the
claim probes the queue for a second waiting tenant first (two index probes) and, without
one, takes the plain claim's pick and charges nothing, unless the tenant has no row yet
or its finish tag lags the virtual time (then it is charged until it has caught up: it
meets the next contention above ``V``, as it would have, charged all along). ``V``
therefore moves only while tenants contend: a tenant back from idle saved credit (at most
``LAG``) from contended claims only.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import IntegrityError, transaction
from django.db.models import Count, F, Max, Min, Q, Value
from django.db.models.functions import Coalesce, Greatest, Now
from django.utils import timezone

from jobs import conf, rules
from jobs.models import FlowRule, Job, TenantShare

# How far (in tags: claims of a weight-1 tenant) a waiting tenant may lag the largest start
# tag before it is floored. Concurrent claims of one tenant push the largest start tag ahead
# of the others' finish tags (each claim of the statement sees the tags as committed before
# it): flooring at the largest tag itself would take that lag away from tenants that were
# waiting all along. A tenant back from idle saved at most this much credit.
LAG = 8.0
# The scope of the default weight: a rule that sets only a weight.
DEFAULT_SCOPE = f"{rules.FLOW_TENANT_PREFIX}*"
WEIGHT_MAX = 10_000


def check_weight(weight: object) -> int | None:
    """A tenant's weight within 1..``WEIGHT_MAX``, or None (the default); else ValueError."""
    if weight is None:
        return None
    try:
        value = int(str(weight).strip())
    except (TypeError, ValueError):
        raise ValueError(f"a weight must be a whole number, not {str(weight)[:40]!r}") from None
    if not 1 <= value <= WEIGHT_MAX:
        raise ValueError(f"a weight must be from 1 to {WEIGHT_MAX:,}, not {value}")
    return value


def check_weight_scope(scope: str, *, weighted: bool, other: bool) -> None:
    """A weight is a tenant's (``tenant:<key>``, or ``tenant:*``, the default); ``tenant:*``
    sets only a weight (its concurrency is ``JOBS_TENANT_CONCURRENCY``); else ValueError."""
    if weighted and not scope.startswith(rules.FLOW_TENANT_PREFIX):
        raise ValueError(f"a weight is a tenant's: tenant:<key> or {DEFAULT_SCOPE}, not {scope}")
    if scope == DEFAULT_SCOPE and other:
        raise ValueError(
            f"{DEFAULT_SCOPE} sets only the default weight; the default concurrency is the "
            "JOBS_TENANT_CONCURRENCY setting"
        )


def weight_of(tenant_key: str) -> float:
    """The tenant's weight: its rule's, else ``tenant:*``'s, else ``JOBS_TENANT_WEIGHT``."""
    scopes = [rules.tenant_scope(tenant_key), DEFAULT_SCOPE]
    found = dict(
        FlowRule.objects.filter(scope__in=scopes, weight__isnull=False).values_list(
            "scope", "weight"
        )
    )
    for scope in scopes:
        if found.get(scope):
            return float(found[scope])
    return float(conf.tenant_weight())


# --- the PostgreSQL claim's functions (jobs.executors.pgclaim) -----------------------------


def _q(name: str) -> str:
    return f'"{name}"' if name != name.lower() else name


_JOB = Job._meta.db_table
_SHARE = TenantShare._meta.db_table
_RULE = FlowRule._meta.db_table
_SINCE = "COALESCE(j.next_attempt_at, j.created_at)"


def _waiting_literal() -> str:
    return rules.literal_sql(rules.all_of(rules.WAITING, rules.NOT_HELD), Job, alias="j", quote=_q)


def _full_sql(bound: str) -> str:
    """True when the head's tenant runs as many live jobs as its bound (its row's
    concurrency, else ``bound``, the setting): it goes last in its band."""
    live = rules.literal_sql(rules.LIVE_RUNNING, Job, alias="r", quote=_q)
    scope = f"'{rules.FLOW_TENANT_PREFIX}' || h.tenant_key"
    return (
        f"(h.tenant_key <> '' AND (SELECT count(*) FROM {_JOB} r WHERE r.tenant_key = "
        f"h.tenant_key AND {live}) >= COALESCE((SELECT f.concurrency FROM {_RULE} f "
        f"WHERE f.scope = {scope}), {bound}))"
    )


PICK_FUNCTION = "jobs_fair_pick_v2"
CHARGE_FUNCTION = "jobs_fair_charge_v1"


def _picking_query() -> str:
    """The fair order's pick in SQL, on ``p_queue`` at ``p_now`` (``pick_function_sql``)."""
    waiting = _waiting_literal()
    cand = rules.literal_sql(rules.CLAIMABLE, Job, alias="j", quote=_q, now="p_now")
    eff = "(h.priority + EXTRACT(EPOCH FROM (p_now - h.since)) / p_aging)"
    full = _full_sql("p_bound")
    return f"""WITH RECURSIVE tenants AS (
        (SELECT j.tenant_key AS k FROM {_JOB} j WHERE j.queue = p_queue AND {waiting}
         ORDER BY j.tenant_key LIMIT 1)
        UNION ALL
        SELECT (SELECT j.tenant_key FROM {_JOB} j WHERE j.queue = p_queue AND {waiting}
            AND j.tenant_key > w.k ORDER BY j.tenant_key LIMIT 1)
        FROM tenants w WHERE w.k IS NOT NULL
    ), vt AS MATERIALIZED (
        SELECT COALESCE(max(s.start), 0)::float8 AS v FROM {_SHARE} s WHERE s.queue = p_queue
    ), heads AS MATERIALIZED (
        SELECT h.* FROM tenants w CROSS JOIN LATERAL (
            SELECT j.id, j.tenant_key, j.priority, {_SINCE} AS since FROM {_JOB} j
            WHERE j.queue = p_queue AND j.tenant_key = w.k AND {cand}
            ORDER BY j.priority DESC, {_SINCE}, j.id LIMIT 1
        ) h WHERE w.k IS NOT NULL
        UNION
        (SELECT j.id, j.tenant_key, j.priority, {_SINCE} FROM {_JOB} j
         WHERE j.queue = p_queue AND {cand} ORDER BY {_SINCE}, j.id LIMIT 1)
    ), band AS MATERIALIZED (
        SELECT h.priority FROM heads h ORDER BY {eff} DESC, h.since, h.id LIMIT 1
    ), ranked AS MATERIALIZED (
        SELECT h.tenant_key, h.priority, row_number() OVER (ORDER BY
            GREATEST(COALESCE(s.finish, vt.v), vt.v - {LAG}), h.since, h.id) AS rank
        FROM heads h CROSS JOIN vt
        LEFT JOIN {_SHARE} s ON s.queue = p_queue AND s.tenant_key = h.tenant_key
        WHERE h.priority = (SELECT priority FROM band)
    )
    SELECT p.id INTO v_id FROM (
        (SELECT h.* FROM (SELECT * FROM ranked ORDER BY rank OFFSET 0) h WHERE NOT {full})
        UNION ALL
        (SELECT h.* FROM (SELECT * FROM ranked ORDER BY rank OFFSET 0) h WHERE {full})
    ) r CROSS JOIN LATERAL (
        SELECT j.id FROM {_JOB} j
        WHERE j.queue = p_queue AND j.tenant_key = r.tenant_key AND j.priority = r.priority
          AND {cand}
        ORDER BY {_SINCE}, j.id LIMIT 1 FOR UPDATE SKIP LOCKED
    ) p LIMIT 1;"""


def pick_function_sql() -> str:
    """``jobs_fair_pick_v2``: the id of the job the fair order takes next, its row locked
    (None: none due, or every one held by another claim).

    The tenants are walked by a skip scan of ``jobs_job_claim_tenant_idx`` (one probe per
    waiting tenant, never a tenant's backlog); only the job taken is locked, ``FOR UPDATE
    SKIP LOCKED``, in the ranked tenants' order: a head another claim holds passes to that
    tenant's next job, then to the next tenant. A tenant at its bound goes last, and that
    is asked of the ranked tenants one by one, only until one below its bound has a job
    to take (v1 counted every waiting tenant's running jobs on every claim).

    A function so that the claim statement stays within psycopg's parse cache (4 KiB); its
    plan is made once per connection and kept (``force_generic_plan``: v1's query was
    planned afresh on every call, and spent more in the planner than in the pick). The
    text is frozen in migration 0035; ``tests/jobs/test_fairness.py`` fails if they drift.
    """
    return f"""
CREATE OR REPLACE FUNCTION {PICK_FUNCTION}(
    p_queue varchar, p_now timestamptz, p_aging float8, p_bound integer
) RETURNS bigint LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_id bigint;
BEGIN
    {_picking_query()}
    RETURN v_id;
END $$;
"""


def charge_function_sql() -> str:
    """``jobs_fair_charge_v1``: charge a tenant one claim (``charge``'s rule): its share row
    upserted at the queue's virtual time, by its weight (its rule's, ``tenant:*``'s, else
    ``p_weight``, the setting); returns the new finish tag. Frozen in migration 0030. The
    claim statement decides whether to call it (``charge_sql``)."""
    weight = (
        f"COALESCE((SELECT f.weight FROM {_RULE} f WHERE f.scope = "
        f"'{rules.FLOW_TENANT_PREFIX}' || p_tenant AND f.weight IS NOT NULL), "
        f"(SELECT f.weight FROM {_RULE} f WHERE f.scope = '{DEFAULT_SCOPE}' "
        "AND f.weight IS NOT NULL), p_weight)::float8"
    )
    top = (
        f"SELECT COALESCE(max(s.start), 0)::float8 INTO v_top FROM {_SHARE} s "
        "WHERE s.queue = p_queue;"
    )
    return f"""
CREATE OR REPLACE FUNCTION {CHARGE_FUNCTION}(
    p_queue varchar, p_tenant varchar, p_weight float8
) RETURNS float8 LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_top float8;
    v_weight float8;
    v_finish float8;
BEGIN
    {top}
    v_weight := {weight};
    INSERT INTO {_SHARE} AS s (queue, tenant_key, start, finish, weight, claims, updated_at)
    VALUES (p_queue, p_tenant, v_top, v_top + 1.0 / v_weight, v_weight, 1, clock_timestamp())
    ON CONFLICT (queue, tenant_key) DO UPDATE SET
        start = GREATEST(s.finish, EXCLUDED.start - {LAG}),
        finish = GREATEST(s.finish, EXCLUDED.start - {LAG}) + 1.0 / EXCLUDED.weight,
        weight = EXCLUDED.weight, claims = s.claims + 1, updated_at = EXCLUDED.updated_at
    RETURNING s.finish INTO v_finish;
    RETURN v_finish;
END $$;
"""


def contended_sql() -> str:
    """The fair claim's ``contended`` CTE (``many``): whether jobs of at least two tenants
    wait in the queue: its first and its last waiting tenant differ. Two probes, one at
    each end of the queue's range of ``jobs_job_claim_tenant_idx`` (an ordered ``LIMIT
    1`` each: a "any other tenant" filter lets the planner scan a lone tenant's flood).
    The order names the index's priority too: only that index yields it, so a generic
    plan cannot take ``(tenant_key, state)`` and walk a tenant's history instead.
    Parameters: the queue, twice.

    Fewer than two, the fair order is the plain one (a lone tenant's turn is its best job
    by effective priority, which is the plain claim's pick): the statement then takes the
    plain claim's candidates and the fair pick does not run (``charge_sql``: the charge
    only when the lone tenant has no row yet or lags)."""
    waiting = _waiting_literal()
    end = (
        f"SELECT j.tenant_key FROM {_JOB} j WHERE j.queue = %s AND {waiting} ORDER BY {{}} LIMIT 1"
    )
    first, last = "j.tenant_key, j.priority DESC", "j.tenant_key DESC, j.priority"
    # Read three times: materialized without saying so (the statement's 4 KiB, pgclaim).
    return f"""contended AS (
            SELECT ({end.format(first)}) <> ({end.format(last)}) AS many
        )"""


def picking_sql(t_now: str, plain: str) -> str:
    """The fair claim's ``picked`` CTE (``id``, ``tenant_key``): with two tenants waiting
    (``contended``), the job ``jobs_fair_pick_v2`` locked, read by its id; else the plain
    claim's pick (the CTE ``plain``, already locked). Each branch behind a one-time filter:
    the other is never run. Parameters: the queue, the aging seconds, the tenant bound."""
    # A scalar subquery: the function runs once (an InitPlan), its id an index condition.
    return f"""picked AS MATERIALIZED (
            SELECT id, tenant_key FROM {plain} WHERE NOT (SELECT many FROM contended)
            UNION ALL
            SELECT id, tenant_key FROM {_JOB} WHERE (SELECT many FROM contended)
              AND id = (SELECT {PICK_FUNCTION}(%s, {t_now}, %s::float8, %s::integer))
        )"""


def picking_params(queue: str, *, aging: float, bound: int) -> list:
    """``picking_sql``'s parameters, in their order."""
    return [queue, aging, bound]


def charge_sql() -> str:
    """The CTE charging the claimed job's tenant (``claimed``) by ``jobs_fair_charge_v1``:
    when two tenants wait (``contended``), or, alone, when the tenant has no share row yet
    or its finish tag lags the queue's virtual time (``lagging``'s rule: it does not come
    to the next contention with credit it used alone). Alone and caught up (a lone
    tenant's every claim after its first), two index reads and no function call. One row
    per claimed row (NULL: not charged); the statement must read it (a CTE without writes
    runs only when read). One parameter: the setting's weight (``JOBS_TENANT_WEIGHT``)."""
    caught_up = (
        f"EXISTS (SELECT 1 FROM {_SHARE} s WHERE s.queue = c.queue AND s.tenant_key = "
        f"c.tenant_key AND s.finish >= (SELECT max(start) FROM {_SHARE} WHERE queue = c.queue))"
    )
    return f"""charged AS MATERIALIZED (
            SELECT CASE WHEN (SELECT many FROM contended) OR NOT {caught_up}
                THEN {CHARGE_FUNCTION}(c.queue, c.tenant_key, %s::float8) END FROM claimed c
        )"""


# --- the ORM claim's same order (jobs.executors.ormclaim) ----------------------------------

_BY_HEAD = ("-priority", Coalesce("next_attempt_at", "created_at"), "pk")
_BY_WAIT = (Coalesce("next_attempt_at", "created_at"), "pk")


@dataclass(frozen=True)
class Ranked:
    """A tenant's place in the band: what orders it, and the band's priority."""

    tenant_key: str
    priority: int
    key: tuple


def _claimable(queue: str, exclude: set[int]):
    rows = Job.objects.filter(rules.to_q(rules.CLAIMABLE), queue=queue)
    return rows.exclude(pk__in=exclude) if exclude else rows


def virtual_time(queue: str) -> float:
    """The queue's virtual time: the largest start tag handed out (0 before any claim)."""
    return float(TenantShare.objects.filter(queue=queue).aggregate(v=Max("start"))["v"] or 0.0)


def contended(queue: str) -> bool:
    """Whether jobs of at least two tenants wait in ``queue`` (``contended_sql``'s rule):
    fewer, the fair order is the plain one and nothing is charged but a lagging tenant."""
    waiting = Job.objects.filter(rules.to_q(rules.all_of(rules.WAITING, rules.NOT_HELD)))
    ends = waiting.filter(queue=queue).aggregate(lo=Min("tenant_key"), hi=Max("tenant_key"))
    return ends["lo"] is not None and ends["lo"] != ends["hi"]


def lagging(queue: str, tenant_key: str) -> bool:
    """Whether a claim the tenant makes alone charges it (``charge_sql``'s rule): it has
    no share row yet, or its finish tag is below the queue's virtual time (it catches up,
    so that the next contention finds it above ``V``, as if charged all along)."""
    mine = Q(tenant_key=tenant_key)
    tags = TenantShare.objects.filter(queue=queue).aggregate(
        v=Max("start"), finish=Max("finish", filter=mine), rows=Count("pk", filter=mine)
    )
    return not tags["rows"] or tags["finish"] < tags["v"]


def _full(tenant_key: str, bound: int) -> bool:
    if not tenant_key:
        return False
    rule = FlowRule.objects.filter(scope=rules.tenant_scope(tenant_key)).first()
    cap = rule.concurrency if rule is not None and rule.concurrency is not None else bound
    live = Job.objects.filter(rules.to_q(rules.LIVE_RUNNING), tenant_key=tenant_key)
    return live.count() >= cap


def ranked(queue: str, v: float, *, exclude: set[int], bound: int) -> list[Ranked]:
    """The band's tenants in the claim's order (``jobs_fair_pick_v2``'s ``ranked``); ``v``:
    the queue's virtual time."""
    waiting = Job.objects.filter(rules.to_q(rules.all_of(rules.WAITING, rules.NOT_HELD)))
    tenants = waiting.filter(queue=queue).values_list("tenant_key", flat=True)
    base = _claimable(queue, exclude).annotate(db_now=Now())
    heads: dict[int, Job] = {}
    for key in sorted(set(tenants.order_by().distinct())):
        head = base.filter(tenant_key=key).order_by(*_BY_HEAD).first()
        if head is not None:
            heads[head.pk] = head
    oldest = base.order_by(*_BY_WAIT).first()
    if oldest is not None:
        heads[oldest.pk] = oldest
    if not heads:
        return []
    aging = rules.aging_seconds()
    band = min(
        heads.values(),
        key=lambda j: (-rules.effective_priority(j, j.db_now, aging), rules.waiting_since(j), j.pk),
    ).priority
    tags = TenantShare.objects.filter(
        queue=queue, tenant_key__in={h.tenant_key for h in heads.values()}
    )
    finish = dict(tags.values_list("tenant_key", "finish"))
    out = []
    for head in heads.values():
        if head.priority != band:
            continue
        tag = max(finish.get(head.tenant_key, v), v - LAG)
        order = (_full(head.tenant_key, bound), tag, rules.waiting_since(head), head.pk)
        out.append(Ranked(head.tenant_key, band, order))
    return sorted(out, key=lambda r: r.key)


def pick(queue: str, *, exclude: set[int], bound: int) -> Job | None:
    """The job the fair order takes next (not locked: the ORM claim takes its claim lock)."""
    base, v = _claimable(queue, exclude), virtual_time(queue)
    for place in ranked(queue, v, exclude=exclude, bound=bound):
        rows = base.filter(tenant_key=place.tenant_key, priority=place.priority)
        job = rows.annotate(flow_ruled=rules.flow_ruled_q(), db_now=Now()).order_by(*_BY_WAIT)
        found = job.first()
        if found is not None:
            return found
    return None


def charge(queue: str, tenant_key: str) -> None:
    """Charge the tenant one claim (``jobs_fair_charge_v1``'s rule): inside the claim's
    transaction. One UPDATE of its row, or its first row inserted."""
    v, weight = virtual_time(queue), weight_of(tenant_key)
    start = Greatest(F("finish"), Value(v - LAG))
    row = TenantShare.objects.filter(queue=queue, tenant_key=tenant_key)
    changes = {
        "start": start,
        "finish": start + Value(1.0 / weight),
        "weight": weight,
        "claims": F("claims") + 1,
        "updated_at": timezone.now(),
    }
    if row.update(**changes):
        return
    try:
        with transaction.atomic():  # a savepoint: a concurrent first claim may insert it
            TenantShare.objects.create(
                queue=queue,
                tenant_key=tenant_key,
                start=v,
                finish=v + 1.0 / weight,
                weight=weight,
                claims=1,
            )
    except IntegrityError:
        row.update(**changes)
