"""The engine's fences and conditions, each written once and rendered two ways.

A rule is a small tree of conditions on one model's columns. ``to_q`` renders it
as a ``Q`` for the ORM paths (``jobs.engine``, ``jobs.executors.orm``, the dispatcher);
``to_sql`` renders the same tree as SQL text for the PostgreSQL statements
(``jobs.executors.postgres``) and the tenant and flow functions. Nothing else spells
these conditions, so the two paths cannot drift apart; ``tests/jobs/test_rules.py`` runs both
renderings against the same rows.

Values in a rule are constants, ``NOW`` (the database server's clock, read when
the statement runs: ``clock_timestamp()`` on PostgreSQL), ``now_plus(arg)``,
``Arg(name)`` (supplied per call) or ``Col(name)`` (another column of the row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import models
from django.db.models import BooleanField, ExpressionWrapper, F, Q, Value

from jobs.clock import ServerNow, after
from jobs.models import Effect, FlowRule, Job

# The advisory lock class every tenant-bound claim takes (with the tenant's hashtext).
TENANT_LOCK_CLASS = 1785684595
# The advisory lock class a claim takes for a ``kind:`` scope with a concurrency rule.
FLOW_LOCK_CLASS = 1785684596
# The advisory lock class (with the job id's hashtext) the one-statement claim of a job
# under a flow rule tries before admission may take rate starts for it.
CLAIM_LOCK_CLASS = 1785684597
# An in-app notice's provider reference: the ledger row names the notice it wrote.
NOTICE_REF_PREFIX = "notice:"
# Why the account rule (``account_admits``) refused a recipient, as the ledger records it.
ACCOUNT_MISSING = "recipient account no longer exists"
ACCOUNT_REFUSED = "recipient account is inactive"


def notice_reference(notice_pk: int) -> str:
    return f"{NOTICE_REF_PREFIX}{notice_pk}"


@dataclass(frozen=True)
class Arg:
    """A value supplied per call (``to_q(rule, job=7)``; a ``%s`` in ``to_sql``)."""

    name: str


@dataclass(frozen=True)
class Col:
    """Another column of the same row."""

    name: str


@dataclass(frozen=True)
class NowPlus:
    """The server's clock plus ``Arg`` seconds."""

    seconds: Arg


NOW = object()


def now_plus(name: str) -> NowPlus:
    return NowPlus(Arg(name))


@dataclass(frozen=True)
class Cond:
    field: str
    op: str  # one of _OPS
    value: Any


@dataclass(frozen=True)
class AllOf:
    parts: tuple


@dataclass(frozen=True)
class AnyOf:
    parts: tuple


_OPS = {"=": "exact", ">": "gt", ">=": "gte", "<": "lt", "<=": "lte", "in": "in", "null": "isnull"}


def all_of(*parts) -> AllOf:
    return AllOf(tuple(parts))


def any_of(*parts) -> AnyOf:
    return AnyOf(tuple(parts))


# --- the rules -------------------------------------------------------------------------

S = Job.State

# A running job whose lease still holds: it counts against its tenant's bound, and a
# delivery that finds it is a duplicate.
LIVE_RUNNING = all_of(Cond("state", "=", S.RUNNING), Cond("lease_expires_at", ">", NOW))

WAITING = Cond("state", "in", (S.QUEUED, S.RETRY_WAIT))
DUE = any_of(Cond("next_attempt_at", "null", True), Cond("next_attempt_at", "<=", NOW))
HAS_BUDGET = Cond("attempts", "<", Col("max_attempts"))
# Not held by a paused scope (``Job.held_by``; ``jobs.flow`` holds and releases).
NOT_HELD = Cond("held_by", "=", "")
# A job a delivery may claim as it is: waiting, not held, due, with attempts left.
CLAIMABLE = all_of(WAITING, NOT_HELD, DUE, HAS_BUDGET)
# A job that must have its own verdict (docs/app/scheduling.md), decided under its row lock
# by one claim: a running job whose lease ran out (reclaimed, or ended when a cancel was
# asked for) and a due job with no attempt left (buried).
OWN_VERDICT = any_of(
    all_of(Cond("state", "=", S.RUNNING), Cond("lease_expires_at", "<=", NOW)),
    all_of(WAITING, DUE, Cond("attempts", ">=", Col("max_attempts"))),
)

# What the dispatcher sweeps, the console counts and a sender may take, by the server's
# clock: jobs with a due time that has come, running jobs whose lease ran out, effects
# due to be sent (a due time of NULL is "now", as for a claim) and sends whose lease ran out.
E = Effect.State
JOB_DUE = all_of(WAITING, NOT_HELD, Cond("next_attempt_at", "<=", NOW))
JOB_LEASE_EXPIRED = all_of(Cond("state", "=", S.RUNNING), Cond("lease_expires_at", "<=", NOW))
# A running job a cancel was asked for: its worker stops at its next check (or, gone, the
# next claim ends it); it can publish nothing, the request moved the version it fences on.
CANCEL_REQUESTED = all_of(Cond("state", "=", S.RUNNING), Cond("cancel_requested_at", "null", False))
EFFECT_DUE = all_of(
    Cond("state", "in", (E.PENDING, E.UNKNOWN)),
    any_of(Cond("next_attempt_at", "null", True), Cond("next_attempt_at", "<=", NOW)),
)
EFFECT_LEASE_EXPIRED = all_of(Cond("state", "=", E.SENDING), Cond("lease_expires_at", "<=", NOW))
EFFECT_RELEASABLE = any_of(EFFECT_DUE, EFFECT_LEASE_EXPIRED)

# Sequences (docs/app/sequences.md). An effect not settled yet: its outcome may still change.
EFFECT_UNSETTLED = Cond("state", "in", (E.PENDING, E.SENDING, E.UNKNOWN))
# The item before a sequence's head lets the head start when it has ended and is not a
# failure that holds its sequence (``on_failure="hold"``, no operator's release), and none
# of its effects is unsettled (``EFFECT_UNSETTLED``, judged beside this rule).
SEQUENCE_PASSES = any_of(
    Cond("state", "in", (S.SUCCEEDED, S.CANCELLED)),
    all_of(
        Cond("state", "in", (S.FAILED, S.DEAD)),
        any_of(Cond("sequence_skip", "=", True), Cond("sequence_released_by", ">", "")),
    ),
)
# A failed or dead item holding its sequence: what an operator's release applies to.
SEQUENCE_HOLDING = all_of(
    Cond("state", "in", (S.FAILED, S.DEAD)),
    Cond("sequence_skip", "=", False),
    Cond("sequence_released_by", "=", ""),
)

# Where each operator arrow starts: the engine's CAS and the admin's buttons read this.
OPERATOR_SOURCES: dict[str, tuple[str, ...]] = {
    "retry_now": (S.QUEUED, S.RETRY_WAIT),
    "cancel": (S.QUEUED, S.RETRY_WAIT, S.RUNNING),  # a running one: at its next check
    "requeue": (S.FAILED, S.DEAD),
    # A job nothing can help (its own parameters are the cause): closed with a reason.
    "fail": (S.QUEUED, S.RETRY_WAIT, S.DEAD),
    # A parent's follow-ups (docs/app/chains.md): only a succeeded job requested any.
    "cancel_follow_ups": (S.SUCCEEDED,),
    "recheck_and_release": (E.WITHHELD,),
    "mark_sent": (E.NEEDS_REVIEW,),
    "send_again": (E.NEEDS_REVIEW,),
}
# Where a redrive of a group starts (jobs.ops.redrive): dead jobs (the requeue's arrow);
# effects with a known refusal or an unknown outcome (effect_machine.redrive).
REDRIVE_SOURCES: dict[str, tuple[str, ...]] = {
    "job": (S.DEAD,),
    "effect": (E.FAILED, E.NEEDS_REVIEW),
}

# The owner fence of a worker's own writes: the version it read, its name on the lease,
# and at least ``margin`` seconds of lease left by the server's clock.
OWNER_FENCE = all_of(
    Cond("id", "=", Arg("job")),
    Cond("version", "=", Arg("version")),
    Cond("lease_owner", "=", Arg("worker")),
    Cond("lease_expires_at", ">", now_plus("margin")),
)

# What ``still_owner`` asks before a private read.
STILL_OWNER = all_of(OWNER_FENCE, Cond("state", "=", S.RUNNING))


# A flow rule (``jobs.models.FlowRule``) that can hold work back: paused, or a concurrency
# or a rate set. For a job of a kind or tenant with such a rule the one-statement claim
# calls ``jobs_flow_admits_v2`` (``flow_function_sql``); whatever it refuses falls to the
# ORM claim, which enforces the same rules (``jobs.engine.admission.admit``) and records why.
FLOW_RULE_ACTIVE = any_of(
    Cond("paused", "=", True), Cond("concurrency", "null", False), Cond("rate", "null", False)
)
# The scopes of a job's claim: its kind's and its tenant's (``jobs.engine.admission.job_scopes``).
FLOW_KIND_PREFIX, FLOW_TENANT_PREFIX = "kind:", "tenant:"
FLOW_PROVIDER_PREFIX = "provider:"
# A queue's scope (``queue:<name>``): its rule holds every job routed to that queue.
FLOW_QUEUE_PREFIX = "queue:"
DEFAULT_QUEUE = "default"


def kind_scope(kind: str) -> str:
    return f"{FLOW_KIND_PREFIX}{kind}"


def tenant_scope(tenant_key: str) -> str:
    return f"{FLOW_TENANT_PREFIX}{tenant_key}"


def queue_scope(queue: str) -> str:
    return f"{FLOW_QUEUE_PREFIX}{queue}"


def provider_scope(provider: str) -> str:
    return f"{FLOW_PROVIDER_PREFIX}{provider}"


def partition_scope(provider: str, tenant_key: str) -> str:
    """A provider's calls for one tenant: ``provider:<name>/tenant:<key>``."""
    return f"{provider_scope(provider)}/{tenant_scope(tenant_key)}"


def scope_provider(scope: str) -> tuple[str, str] | None:
    """``(provider, tenant key or "")`` of a ``provider:`` scope, else None."""
    if not scope.startswith(FLOW_PROVIDER_PREFIX):
        return None
    rest = scope.removeprefix(FLOW_PROVIDER_PREFIX)
    provider, _, tenant = rest.partition("/" + FLOW_TENANT_PREFIX)
    return provider, tenant


# The rate rule (GCRA, ``jobs.flow``) in SQL, for a rule row ``{r}`` and the server's time
# ``{now}``: a start is due when the row's next free time has come, and moves it on by
# one interval from then. ``jobs.engine.admission.take`` and the claim's function use the same text.
GCRA_DUE_SQL = "({r}next_free_at IS NULL OR {r}next_free_at <= {now})"
GCRA_NEXT_SQL = (
    "GREATEST(COALESCE({r}next_free_at, {now}), {now})"
    " + make_interval(secs => {r}period_seconds / {r}rate)"
)


def _active_rule_sql(scopes: Callable[[str], str], quote: Callable[[str], str]) -> Rendered:
    """``EXISTS`` an active flow rule whose scope column meets ``scopes(column)``."""
    active = to_sql(FLOW_RULE_ACTIVE, FlowRule, alias="r", quote=quote)
    scope = quote(FlowRule._meta.get_field("scope").column)
    text = (
        f"EXISTS (SELECT 1 FROM {quote(FlowRule._meta.db_table)} r WHERE "
        f"{scopes(f'r.{scope}')} AND {active.text})"
    )
    return Rendered(text, active.slots)


def flow_ruled_sql(job_alias: str = "", quote: Callable[[str], str] = lambda n: f'"{n}"'):
    """``EXISTS`` an active flow rule on the job's kind, tenant or queue, as SQL on the job
    row (``flow_ruled_q``'s rule)."""
    prefix = f"{job_alias}." if job_alias else ""
    return _active_rule_sql(
        lambda column: (
            f"{column} IN ('{FLOW_KIND_PREFIX}' || {prefix}{quote('kind')}, "
            f"'{FLOW_TENANT_PREFIX}' || {prefix}{quote('tenant_key')}, "
            f"'{FLOW_QUEUE_PREFIX}' || {prefix}{quote('queue')})"
        ),
        quote,
    )


def flow_ruled_q():
    """The same ``EXISTS`` as an ORM expression on a ``Job`` queryset (annotate with it)."""
    from django.db.models import Exists, OuterRef, Value
    from django.db.models.functions import Concat

    return Exists(
        FlowRule.objects.filter(to_q(FLOW_RULE_ACTIVE)).filter(
            Q(scope=Concat(Value(FLOW_KIND_PREFIX), OuterRef("kind")))
            | Q(scope=Concat(Value(FLOW_TENANT_PREFIX), OuterRef("tenant_key")))
            | Q(scope=Concat(Value(FLOW_QUEUE_PREFIX), OuterRef("queue")))
        )
    )


# --- the claim's order (docs/app/scheduling.md) ------------------------------------------


def aging_seconds() -> float:
    """Seconds of waiting that raise a job's effective priority by one level."""
    from jobs import conf

    return float(conf.get("JOBS_PRIORITY_AGING_SECONDS"))


def waiting_since(job: Job):
    """When the job became due: its due time, else when it was asked for."""
    return job.next_attempt_at or job.created_at


def effective_priority(job: Job, now, aging: float) -> float:
    """``priority`` plus one level per ``aging`` seconds waited (the claim's order)."""
    return job.priority + (now - waiting_since(job)).total_seconds() / aging


def effective_priority_sql(alias: str = "", now: str = "clock_timestamp()") -> str:
    """``effective_priority`` as SQL on a job row; one ``%s``: the aging seconds."""
    p = f"{alias}." if alias else ""
    return f"({p}priority + EXTRACT(EPOCH FROM ({now} - {waiting_since_sql(alias)})) / %s::float8)"


def waiting_since_sql(alias: str = "") -> str:
    p = f"{alias}." if alias else ""
    return f"COALESCE({p}next_attempt_at, {p}created_at)"


def account_admits(user_model: type[models.Model]) -> AllOf:
    """The default release rule: the account is active (where the model has the flag).

    Used by the release check in Python (``jobs.delivery.policy``) and inside the publish
    statement (``jobs.executors.postgres``), so a notice commits only to an account the rule admits.
    """
    try:
        field = user_model._meta.get_field("is_active")
    except Exception:  # a custom user model without the flag admits every account
        return all_of()
    return all_of(Cond(field.name, "=", True)) if field.concrete else all_of()


def admitted(user_model: type[models.Model]) -> ExpressionWrapper | Value:
    """``account_admits`` as a column the database computes per account (annotate with it).

    The release check (``jobs.delivery.policy``) and the ORM publish
    (``jobs.executors.orm``) read it.
    """
    rule = to_q(account_admits(user_model))
    return ExpressionWrapper(rule, output_field=BooleanField()) if rule else Value(True)


# --- rendering -------------------------------------------------------------------------


def _value_for_q(value, args: dict):
    if value is NOW:
        return ServerNow()
    if isinstance(value, Arg):
        return args[value.name]
    if isinstance(value, Col):
        return F(value.name)
    if isinstance(value, NowPlus):
        seconds = args[value.seconds.name]
        return after(float(seconds)) if seconds else ServerNow()
    return value


def to_q(rule, **args) -> Q:
    """The rule as a ``Q`` for the ORM, with ``args`` filled in."""
    if isinstance(rule, AllOf):
        q = Q()
        for part in rule.parts:
            q &= to_q(part, **args)
        return q
    if isinstance(rule, AnyOf):
        q = Q()
        for part in rule.parts:
            q |= to_q(part, **args)
        return q
    lookup = "pk" if rule.field == "id" else rule.field
    return Q(**{f"{lookup}__{_OPS[rule.op]}": _value_for_q(rule.value, args)})


_COMPARE = {
    "=": lambda a, b: a == b,
    ">": lambda a, b: a is not None and b is not None and a > b,
    ">=": lambda a, b: a is not None and b is not None and a >= b,
    "<": lambda a, b: a is not None and b is not None and a < b,
    "<=": lambda a, b: a is not None and b is not None and a <= b,
    "in": lambda a, b: a in b,
    "null": lambda a, b: (a is None) == bool(b),
}


def holds(rule, obj: models.Model, *, now, **args) -> bool:
    """The rule judged on a row already read (``now``: the server's clock read with it).

    The ORM claim reads the job once and decides from it what a delivery was; it
    asks the same rules the statements embed. (A comparison with NULL is false, as
    in SQL.)
    """
    if isinstance(rule, AllOf):
        return all(holds(p, obj, now=now, **args) for p in rule.parts)
    if isinstance(rule, AnyOf):
        return any(holds(p, obj, now=now, **args) for p in rule.parts)
    value = rule.value
    if value is NOW:
        value = now
    elif isinstance(value, Arg):
        value = args[value.name]
    elif isinstance(value, Col):
        value = getattr(obj, value.name)
    elif isinstance(value, NowPlus):
        from datetime import timedelta

        value = now + timedelta(seconds=float(args[value.seconds.name]))
    actual = getattr(obj, "pk" if rule.field == "id" else rule.field)
    return _COMPARE[rule.op](actual, value)


@dataclass(frozen=True)
class Rendered:
    """A rule as SQL: ``text`` with ``%s`` placeholders and, per placeholder, how to get
    its value (a constant, or an ``Arg`` filled in by ``params``)."""

    text: str
    slots: tuple

    def params(self, **args) -> list:
        return [args[s.name] if isinstance(s, Arg) else s for s in self.slots]


def to_sql(
    rule,
    model: type[models.Model],
    *,
    alias: str = "",
    now: str = "clock_timestamp()",
    quote: Callable[[str], str] = lambda name: f'"{name}"',
) -> Rendered:
    """The rule as a SQL condition on ``model``'s columns (prefixed by ``alias.``)."""
    slots: list = []

    def column(name: str) -> str:
        f = model._meta.pk if name == "id" else model._meta.get_field(name)
        return f"{alias + '.' if alias else ''}{quote(f.column)}"

    def value(v) -> str:
        if v is NOW:
            return now
        if isinstance(v, Col):
            return column(v.name)
        if isinstance(v, NowPlus):
            slots.append(v.seconds)
            return f"{now} + make_interval(secs => %s)"
        slots.append(v)
        return "%s"

    def render(r) -> str:
        if isinstance(r, AllOf | AnyOf):
            if not r.parts:
                return "TRUE"
            joiner = " AND " if isinstance(r, AllOf) else " OR "
            return "(" + joiner.join(render(p) for p in r.parts) + ")"
        col = column(r.field)
        if r.op == "null":
            return f"{col} IS {'' if r.value else 'NOT '}NULL"
        if r.op == "in":
            return f"{col} IN ({', '.join(value(v) for v in r.value)})"
        if isinstance(r.value, bool):
            return col if r.value else f"NOT {col}"
        return f"{col} {r.op} {value(r.value)}"

    return Rendered(render(rule), tuple(slots))


def literal_sql(rule, model: type[models.Model] = Job, **options) -> str:
    """A rule without ``Arg`` as SQL with its constants (states, numbers) written in as
    literals: a partial index's predicate is then provably implied, prepared or not."""
    rendered = to_sql(rule, model, **options)
    text = rendered.text
    for constant in rendered.params():
        if isinstance(constant, Arg):
            raise ValueError(f"{constant.name}: a rule with arguments has no literal form")
        if isinstance(constant, bool) or not isinstance(constant, int | float):
            constant = "'" + str(constant).replace("'", "''") + "'"
        text = text.replace("%s", str(constant), 1)
    return text


def _live_running_literal() -> str:
    """``LIVE_RUNNING`` as SQL with its constants (states) written in as literals."""
    return literal_sql(LIVE_RUNNING, Job, quote=lambda n: n)


def tenant_function_sql(version: int = 2) -> str:
    """The tenant bound of the one-statement claim: try the tenant's lock, then count.

    A VOLATILE function takes a fresh snapshot for each query it runs, so the count,
    taken after the lock, sees every claim committed before it. It never waits for
    the lock (``pg_try_advisory_xact_lock``): a busy tenant makes the statement claim
    nothing, and the ORM claim waits for the lock under its lock timeout instead.
    Migration 0008 holds this text frozen; ``tests/jobs/test_rules.py`` checks it.
    """
    text = _live_running_literal()
    return f"""
CREATE OR REPLACE FUNCTION jobs_tenant_admits_v{version}(
    p_tenant varchar, p_job bigint, p_bound integer
) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock({TENANT_LOCK_CLASS}, hashtext(p_tenant)) THEN
        RETURN false;
    END IF;
    RETURN (
        SELECT count(*) FROM {Job._meta.db_table}
        WHERE tenant_key = p_tenant AND {text} AND id <> p_job
    ) < p_bound;
END $$;
"""


def flow_function_sql(version: int = 2) -> str:
    """The flow rules of a job's kind and tenant, judged by the one-statement claim.

    The same procedure as the ORM claim's ``jobs.engine.admission.admit``: pause; the
    kind's concurrency (its scope's lock, then a count of live running jobs of the
    kind); the tenant's (``jobs_tenant_admits_v2`` with the row's bound, else
    ``p_bound``, the setting); then the rates, last and all-or-nothing: the rated rows
    are locked in id order, every one judged, and only if all allow a start is one
    taken from each (version 1 took the kind's start before judging the tenant's, and
    a refusal by the second kept the first spent). Locks are tried, never waited for,
    and any "no" makes the statement claim nothing: the ORM claim then decides again,
    waits where it may, and records the deferral. The claim calls it from a CTE of its
    own, after the job's row is locked, never inside the UPDATE's WHERE (which the
    server may evaluate again after a concurrent update). Migration 0014 holds this
    text frozen (0013 version 1); ``tests/jobs/test_rules.py`` checks it.
    """
    if version != 2:
        raise ValueError("only version 2 is generated; version 1 is frozen in migration 0013")
    table, live = FlowRule._meta.db_table, _live_running_literal()
    kind_scope = f"'{FLOW_KIND_PREFIX}' || p_kind"
    rated = "r.id IN (k_id, t_id) AND r.rate > 0"
    due = GCRA_DUE_SQL.format(r="r.", now="v_now")
    take = GCRA_NEXT_SQL.format(r="r.", now="v_now")
    return f"""
CREATE OR REPLACE FUNCTION jobs_flow_admits_v{version}(
    p_kind varchar, p_tenant varchar, p_job bigint, p_bound integer
) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    k_id bigint;
    k_paused boolean;
    k_concurrency integer;
    k_rate integer;
    t_id bigint;
    t_paused boolean;
    t_concurrency integer;
    t_rate integer;
    v_now timestamptz;
    v_locked integer;
BEGIN
    SELECT id, paused, concurrency, rate INTO k_id, k_paused, k_concurrency, k_rate
    FROM {table} WHERE scope = {kind_scope};
    IF p_tenant <> '' THEN
        SELECT id, paused, concurrency, rate INTO t_id, t_paused, t_concurrency, t_rate
        FROM {table} WHERE scope = '{FLOW_TENANT_PREFIX}' || p_tenant;
    END IF;
    IF COALESCE(k_paused, false) OR COALESCE(t_paused, false) THEN
        RETURN false;
    END IF;
    IF k_concurrency IS NOT NULL THEN
        IF NOT pg_try_advisory_xact_lock({FLOW_LOCK_CLASS}, hashtext({kind_scope})) THEN
            RETURN false;
        END IF;
        IF (
            SELECT count(*) FROM {Job._meta.db_table}
            WHERE kind = p_kind AND {live} AND id <> p_job
        ) >= k_concurrency THEN
            RETURN false;
        END IF;
    END IF;
    IF p_tenant <> '' THEN
        IF NOT jobs_tenant_admits_v2(p_tenant, p_job, COALESCE(t_concurrency, p_bound)) THEN
            RETURN false;
        END IF;
    END IF;
    IF COALESCE(k_rate, 0) > 0 OR COALESCE(t_rate, 0) > 0 THEN
        SELECT count(*) INTO v_locked FROM (
            SELECT r.id FROM {table} r WHERE {rated} ORDER BY r.id FOR UPDATE SKIP LOCKED
        ) l;
        IF v_locked < (SELECT count(*) FROM {table} r WHERE {rated}) THEN
            RETURN false;
        END IF;
        v_now := clock_timestamp();
        IF EXISTS (SELECT 1 FROM {table} r WHERE {rated} AND (r.paused OR NOT {due})) THEN
            RETURN false;
        END IF;
        UPDATE {table} r SET next_free_at = {take} WHERE {rated};
    END IF;
    RETURN true;
END $$;
"""
