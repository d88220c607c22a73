"""The PostgreSQL claim of the next due job of a queue: the dequeue of the one queue.

``jobs.claiming.ClaimingBroker`` calls this for each idle worker of its cluster: the
jobs table is the queue, there is no message naming a job. One statement picks the
queue's next job (its two candidates, the best by priority and the longest waiting,
each ``FOR UPDATE SKIP LOCKED``: the row is locked before any admission, and a
concurrent claim on another host passes over it), admits it and starts it, under the
rules rendered from ``jobs.rules``.

The admission's verdict on the job it picked (``jobs_flow_verdict_v2``) is decided
once, in the statement: a job held back is deferred as the verdict says (scope,
reason, delay; no attempt spent), by the engine's ``verdict.defer``, and nothing
decides about it again. A job that must have its own verdict (an expired lease, a
spent budget: ``rules.OWN_VERDICT``) is picked under its row lock and decided by the
engine's ``verdict.decide`` in the same transaction, so two hosts never both decide
about it.
"""

from __future__ import annotations

import functools
import logging
from contextlib import nullcontext

from django.db import DatabaseError, connection, transaction
from django.db.models.functions import Now

from jobs import broker, clock, conf, fairness, queue, rules
from jobs.engine import admission, job_machine, verdict
from jobs.engine.plan import Claim
from jobs.engine.refusals import refusal
from jobs.executors.pgsql import NOW, _compact, _cursor, _int8, _job_from_row, _q, _tight
from jobs.models import SEQUENCE_HELD, Attempt, Effect, Job

log = logging.getLogger("jobs.executors")


def _statement(picking: str, *, fair: bool = False) -> str:
    """The claim's statement around its ``picked`` CTE (``id``, ``tenant_key``): the job
    picked under its row lock, then its claim lock, verdict, start and attempt
    (``start_ctes``), the fair share's charge (``fair``), and the verdict read back."""
    charge = f", {fairness.charge_sql()}" if fair else ""
    charged = " CROSS JOIN charged" if fair else ""
    text = f"""
        WITH t AS MATERIALIZED (
            SELECT {NOW} AS now,
                CASE WHEN %s THEN set_config('synchronous_commit', 'off', true)
                    || set_config('lock_timeout', %s, true) END AS alone
        ), {picking}, {start_ctes("picked")}{charge}
        SELECT claimed.*, attempt.id, attempt.started_at, (SELECT id FROM picked),
            (SELECT (v).scope FROM judged), (SELECT (v).reason FROM judged),
            (SELECT (v).delay FROM judged)
        FROM (SELECT 1) one LEFT JOIN (claimed CROSS JOIN attempt{charged}) ON true
    """
    return _compact(text)


def _candidates(queue: str) -> str:
    """A queue's two candidates (``by_priority``, ``by_wait``): each the first row of one
    of migration 0022's partial indexes, locked or skipped (a job another claim holds is
    passed over, never waited for). One ``%s`` each: the aging seconds."""
    job_t = _q(Job._meta.db_table)
    t_now = "(SELECT now FROM t)"
    cand = rules.literal_sql(rules.CLAIMABLE, Job, alias="j", quote=_q, now=t_now)
    since = rules.waiting_since_sql("j")
    eff = rules.effective_priority_sql("j", now=t_now)
    candidate = f"""
        SELECT j.id, j.tenant_key, {eff} AS eff, {since} AS since FROM {job_t} j
        WHERE j.queue = {queue} AND {cand}"""
    return f"""by_priority AS MATERIALIZED (
            {candidate} ORDER BY j.priority DESC, {since}, j.id LIMIT 1 FOR UPDATE SKIP LOCKED
        ), by_wait AS MATERIALIZED (
            {candidate} ORDER BY {since}, j.id LIMIT 1 FOR UPDATE SKIP LOCKED
        ), best AS MATERIALIZED (
            SELECT id, tenant_key, eff FROM (
                SELECT * FROM by_priority UNION ALL SELECT * FROM by_wait
            ) c ORDER BY c.eff DESC, c.since, c.id LIMIT 1
        )"""


@functools.cache
def _next_statement() -> str:
    return _statement(
        _candidates("%s") + ", picked AS MATERIALIZED (SELECT id, tenant_key FROM best)"
    )


@functools.cache
def _fair_statement() -> str:
    # The plain claim's candidates and the fair pick, each behind the probe for a second
    # waiting tenant (``fairness.contended_sql``): only one of them runs.
    t_now = "(SELECT now FROM t)"
    picking = ", ".join(
        (fairness.contended_sql(), _candidates("%s"), fairness.picking_sql(t_now, "best"))
    )
    # Within psycopg's 4 KiB parse cache (``_tight``).
    return _tight(_statement(picking, fair=True))


def next_statement(queue: str, worker: str, *, lease: float, bound: int) -> tuple[str, list]:
    """The statement claiming ``queue``'s next job for ``worker``, and its parameters: in
    the fair share's order across tenants (``jobs.fairness``) unless ``JOBS_FAIR_SHARE``
    is off, then by effective priority and due time alone."""
    aging = rules.aging_seconds()
    start = start_params(worker, lease=lease, bound=bound)
    plain = [aging, queue, aging, queue]
    if conf.fair_share():
        picking = fairness.picking_params(queue, aging=aging, bound=bound)
        params = [*_head(), queue, queue, *plain, *picking, *start, conf.tenant_weight()]
        return _fair_statement(), params
    return _next_statement(), [*_head(), *plain, *start]


# The longest a claim waits for a scope's lock (held for one claim statement, or by a
# worker transaction the server ends within its idle timeout): then the claim passes.
LOCK_WAIT_CAP_SECONDS = 2.0


def _head() -> list:
    """The ``t`` CTE's parameters: alone in its transaction, the statement commits without
    waiting for the WAL flush (docs/decisions.md, "Work starts when it is committed") and
    waits at most this long for a scope's lock; inside a caller's transaction nothing
    changes (the caller owns its timeouts)."""
    wait = min(LOCK_WAIT_CAP_SECONDS, conf.lock_timeout_seconds())
    return [not connection.in_atomic_block, f"{max(1, int(wait * 1000))}ms"]


def start_ctes(source: str) -> str:
    """The claim's last steps on the job ``(SELECT id FROM <source>)``, as CTEs: its claim
    lock tried, the admission's verdict (``jobs_flow_verdict_v2``, only for a job with
    an active flow rule or a tenant), the start (the CAS) and the attempt row, with the
    time the job was due (its wait); ``judged`` holds the verdict. Its parameters are
    ``start_params``'s."""
    job_t, attempt_t = _q(Job._meta.db_table), _q(Attempt._meta.db_table)
    claimable = rules.to_sql(rules.CLAIMABLE, Job, quote=_q)
    since = rules.waiting_since_sql()
    ruled = rules.flow_ruled_sql(job_t, quote=_q)
    assert not ruled.slots, "the rule conditions have no parameters"
    # The verdict is computed once, in a CTE of its own (never in the UPDATE's WHERE,
    # which the server may evaluate again after a concurrent update), and read from it.
    return f"""locked AS MATERIALIZED (
            SELECT id, kind, tenant_key, queue, {ruled.text} AS ruled, {since} AS due
            FROM {job_t}
            WHERE id = (SELECT id FROM {source}) AND {claimable.text}
              AND pg_try_advisory_xact_lock({rules.CLAIM_LOCK_CLASS}, hashtext(id::text))
        ), judged AS MATERIALIZED (
            SELECT id, tenant_key, CASE WHEN ruled OR tenant_key <> '' THEN
                jobs_flow_verdict_v2(kind, tenant_key, queue, id, %s::integer, %s::float8,
                    %s::float8) END AS v
            FROM locked
        ), admitted AS MATERIALIZED (
            SELECT id FROM judged WHERE COALESCE((v).reason, '') = ''
        ), claimed AS (
            UPDATE {job_t} SET
                state = %s, attempts = attempts + 1, lease_owner = %s,
                lease_expires_at = {NOW} + make_interval(secs => %s),
                next_attempt_at = NULL, deferred_by = '', started_at = COALESCE(started_at, {NOW}),
                version = version + 1, updated_at = {NOW}
            WHERE id = (SELECT id FROM admitted) AND {claimable.text}
            RETURNING *
        ), attempt AS (
            INSERT INTO {attempt_t}
                (job_id, number, worker, started_at, outcome, error_class, error_code, due_at)
            SELECT id, attempts, %s, {NOW}, '', '', '', (SELECT due FROM locked) FROM claimed
            RETURNING id, started_at
        )"""


def start_params(worker: str, *, lease: float, bound: int) -> list:
    """``start_ctes``'s parameters, in their order."""
    claimable = rules.to_sql(rules.CLAIMABLE, Job, quote=_q).params()
    judged = admission.verdict_params(bound)
    return [*claimable, *judged, Job.State.RUNNING, worker, float(lease), *claimable, worker]


# The claim's job columns by the length of its row (a migration that adds a column while a
# worker runs changes the length, and the names are read again).
_columns: dict[int, list[str]] = {}


def claim_next(queue: str, worker: str, *, lease: float, bound: int) -> Claim | None:
    """Claim ``queue``'s next due job for ``worker``: the claim, a verdict on the job it
    picked and could not start (deferred, ...), or None when the queue has no due job.
    Finding none, it releases the sequences' heads that may start (``release_heads``)
    and, if it released one, looks once more: a sequenced job is claimed only as its
    key's head, after the job before it passed (docs/app/sequences.md)."""
    claim = _claim(*next_statement(queue, worker, lease=lease, bound=bound), worker)
    if claim is None and release_heads():
        claim = _claim(*next_statement(queue, worker, lease=lease, bound=bound), worker)
    return claim


@functools.cache
def _heads_statement(*, one_key: bool = False, lazy: bool = False) -> str:
    """Release the heads that may start: every blocked key's (one index probe per key, a
    skip scan), or ``one_key``'s alone (its key the statement's first parameter); the
    others are ``broker.channel_params()``. ``lazy``: its commit does not wait for the
    disk (only for a statement that is its own transaction)."""
    job_t, effect_t = _q(Job._meta.db_table), _q(Effect._meta.db_table)
    # Literals, so the partial indexes' predicates (migration 0032) are provably implied:
    # without ``p.sequence_key <> ''`` the job before a head (its key a lateral value, not
    # a literal) was found by a scan of the whole table, a release growing with history.
    # The plan must not hang on fresh statistics either (a burst of requests just
    # written, before any ANALYZE): ``ready`` is worked out once (MATERIALIZED; inlined,
    # it was run again for every held row, seconds with a few hundred held), a head
    # is read in its index's own order, and a ready head is updated by its key and id:
    # both columns of the held index, so a plan made while that index looked empty
    # (a generic plan kept for a worker's connection) probes it, never walks it (by id
    # alone, 1,986 rows read a job over a bench run of 2,000 sequenced jobs).
    held = f"j.held_by = '{SEQUENCE_HELD}' AND j.state = '{Job.State.QUEUED}'"
    passes = rules.literal_sql(rules.SEQUENCE_PASSES, Job, alias="p", quote=_q)
    unsettled = rules.literal_sql(rules.EFFECT_UNSETTLED, Effect, alias="e", quote=_q)
    # Non-modifying CTEs run only when read: the released rows' filter reads both (once).
    lazy_cte = ", lazy AS (SELECT set_config('synchronous_commit', 'off', true) AS c)"
    lazy_cte, lazy_where = (lazy_cte, " AND (SELECT c FROM lazy) IS NOT NULL") if lazy else ("", "")
    if one_key:
        keys = "keys AS (SELECT %s::varchar AS k)"
        # At most one head: the update names it by value (a point probe of the primary
        # key or of the held index by key and id, whatever the plan thinks of their size).
        target = "(SELECT id FROM ready) AND j.sequence_key = (SELECT k FROM ready)"
        source, match = "", f"j.id = {target}"
    else:
        keys = f"""RECURSIVE keys AS (
            (SELECT j.sequence_key AS k FROM {job_t} j WHERE {held}
             ORDER BY j.sequence_key LIMIT 1)
            UNION ALL
            SELECT (SELECT j.sequence_key FROM {job_t} j WHERE {held} AND j.sequence_key > w.k
                    ORDER BY j.sequence_key LIMIT 1)
            FROM keys w WHERE w.k IS NOT NULL
        )"""
        source, match = " FROM ready r", "j.sequence_key = r.k AND j.id = r.id"
    return _compact(
        f"""WITH {keys}, heads AS (
            SELECT h.id, h.sequence_key FROM keys w CROSS JOIN LATERAL (
                SELECT j.id, j.sequence_key FROM {job_t} j WHERE {held} AND j.sequence_key = w.k
                ORDER BY j.sequence_key, j.id LIMIT 1) h
        ), ready AS MATERIALIZED (
            SELECT h.id, h.sequence_key AS k FROM heads h LEFT JOIN LATERAL (
                SELECT p.* FROM {job_t} p WHERE p.sequence_key = h.sequence_key AND p.id < h.id
                AND p.sequence_key <> '' ORDER BY p.id DESC LIMIT 1) p ON true
            WHERE p.id IS NULL OR ({passes} AND NOT EXISTS (
                SELECT 1 FROM {effect_t} e WHERE e.job_id = p.id AND {unsettled}))
        ), released AS (
            UPDATE {job_t} j SET held_by = '', updated_at = {NOW}
           {source} WHERE {match} AND {held}
            RETURNING j.id, j.kind, j.queue
        ), woken AS (
            SELECT pg_notify(c, '') FROM (SELECT DISTINCT {broker.channel_sql("r.queue")} AS c
            FROM released r WHERE r.queue <> ALL(%s::varchar[])) q
        ){lazy_cte}
        SELECT r.id, r.kind FROM released r WHERE (SELECT count(*) FROM woken) >= 0{lazy_where}"""
    )


def next_release_sql() -> tuple[str, str]:
    """A sequenced job's publish, when every effect of the job settles in it, looks at its
    own key in its own statement: the CTEs and the column that release the key's head
    when the job being published is the one before it (it succeeds here, and a job has
    no effect before its publish, the only writer of its effects, which happens once),
    and wake the published job's queue (unless the caller's cluster claims from it next:
    ``queue.claimed_next_here``). Returns (CTEs to follow the publish's ``job``
    CTE, a column reading back the released id, kind and queue); their parameters are
    ``next_release_params``'s, in that order. The same rule as ``_heads_statement``'s,
    for one key, with the job before the head known: saves the delivery a statement and
    a commit after its publish. Short: with it the publish stays within psycopg's 4 KiB
    parse cache (``postgres._publish_statement``)."""
    job_t = _q(Job._meta.db_table)
    held = f"h.held_by = '{SEQUENCE_HELD}' AND h.state = '{Job.State.QUEUED}'"
    # The head is updated by its id and key (a point probe whatever the plan believes
    # is held, as ``_heads_statement``'s); the job before it is the key's last job below
    # it (``max``: the sequence index read backwards, from the head).
    ctes = f""", head AS (
            SELECT h.id FROM {job_t} h WHERE {held} AND h.sequence_key = %s
            ORDER BY h.id LIMIT 1
        ), released AS (
            UPDATE {job_t} h SET held_by = '', updated_at = {NOW}
            WHERE h.id = (SELECT id FROM head) AND h.sequence_key = %s AND {held}
              AND EXISTS (SELECT 1 FROM job)
              AND (SELECT max(b.id) FROM {job_t} b WHERE b.sequence_key = %s
                   AND b.sequence_key <> '' AND b.id < h.id) = %s
            RETURNING h.id, h.kind, h.queue
        )"""
    # The published job's queue is woken when asked (a head of another queue, a key
    # across kinds, is woken by the caller from the queue read back): once per released
    # row, never without one.
    column = (
        "(SELECT ARRAY[r.id::text, r.kind, r.queue, "
        "CASE WHEN %s THEN pg_notify(%s, '')::text END] FROM released r)"
    )
    return ctes, column


def next_release_params(job: Job, *, channel: str, wake: bool = True) -> tuple[list, list]:
    """``next_release_sql``'s parameters: its CTEs', its column's (``channel``: the
    published job's queue's; ``wake``: NOTIFY it if a head is released)."""
    key = job.sequence_key
    return [key, key, key, _int8(job.pk)], [wake, channel]


def log_released(row) -> None:
    """The arrow of a head a publish released (``next_release_sql``'s column)."""
    if row:
        log.info("job=%s kind=%s arrow=sequence_head", row[0], row[1])


def release_heads(key: str | None = None) -> int:
    """Release to the claim every sequence's head whose job before it passed (ended, not
    a failure that holds, no effect unsettled: ``rules.SEQUENCE_PASSES``), or ``key``'s
    alone, and wake their queues (but those the calling cluster worker's cluster claims
    from next: ``queue.claiming_next``), in one statement: one probe of the held index per key
    with a held job, one for the job before its head (``sequences.sweep`` and
    ``sequences.advance`` are the ORM's). Returns how many.

    Its commit does not wait for the disk (``synchronous_commit`` off for it alone): a
    release is worked out again from the rows it read, so one a crash loses is made
    again by the next look (a claim that finds nothing, the dispatcher's round); the
    claim of the released job waits for the disk, and flushes the release with it. In a
    caller's transaction (a request's) the caller's commit is left as it is."""
    lazy = not connection.in_atomic_block
    with _cursor() as cursor:
        cursor.execute(_heads_statement(one_key=key is not None, lazy=lazy), heads_params(key))
        rows = cursor.fetchall()
    for job_id, kind in rows:
        log.info("job=%s kind=%s arrow=sequence_head", job_id, kind)
    return len(rows)


def heads_params(key: str | None = None) -> list:
    """``_heads_statement``'s parameters: ``key`` (the one key's statement only), the
    channels', and the queues not to wake: those this delivery's cluster claims from as
    soon as it ends (``queue.claiming_next``), which start what is released to them."""
    own = [] if key is None else [key]
    return [*own, *broker.channel_params(), sorted(queue.claimed_next())]


def _claim(sql: str, params: list, worker: str) -> Claim | None:
    try:
        inner = transaction.atomic() if connection.in_atomic_block else nullcontext()
        with inner, _cursor() as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
            names = _columns.get(len(row))
            if names is None:
                names = _columns[len(row)] = [d.name for d in cursor.description[:-6]]
    except DatabaseError as exc:
        if refusal(exc) != "lock_not_available":
            raise
        # A scope's lock held past the wait: nothing was written; the job stays due.
        log.info("claim gave way: a scope's lock was held past %s", params[1])
        return Claim("passed")
    *values, attempt_id, started_at, picked, scope, reason, delay = row
    if picked is None:
        return None
    if attempt_id is None:
        hold = admission.hold_of(scope, reason, delay)
        if hold is None:
            # Another claim is deciding about it (its claim lock): the queue's next one.
            return Claim("passed")
        return verdict.defer(picked, worker, hold)
    job = _job_from_row(names, values)
    attempt = Attempt(
        pk=attempt_id, job=job, number=job.attempts, worker=worker, started_at=started_at
    )
    attempt._state.adding, attempt._state.db = False, job._state.db
    job_machine.log_arrow(job, "claim", worker, reclaimed=False)
    return Claim("claimed", job, attempt)


@functools.cache
def _read_claim_statement() -> str:
    job_t, attempt_t = _q(Job._meta.db_table), _q(Attempt._meta.db_table)
    return _compact(
        f"""SELECT j.*, a.number, a.worker, a.started_at, a.outcome, {NOW}
        FROM {attempt_t} a JOIN {job_t} j ON j.id = a.job_id WHERE a.id = %s AND a.job_id = %s"""
    )


# The adopting read's job columns by the length of its row (as ``_columns``).
_read_columns: dict[int, list[str]] = {}


def read_claim(job_id: int, attempt_id: int) -> Attempt | None:
    """The attempt a claim started, its ``job`` and the server's clock (``db_now``): the
    worker's adoption of the claim, one statement rendered once (the ORM's join of the
    two models cost more Python than the round trip). Its own health check: run it
    through ``clock.checked_by``."""
    with _cursor(health_check=False) as cursor:
        cursor.execute(_read_claim_statement(), [_int8(attempt_id), _int8(job_id)])
        row = cursor.fetchone()
        if row is None:
            return None
        names = _read_columns.get(len(row))
        if names is None:
            names = _read_columns[len(row)] = [d.name for d in cursor.description[:-5]]
    *values, number, worker, started_at, outcome, db_now = row
    job = _job_from_row(names, values)
    attempt = Attempt(
        pk=attempt_id, job=job, number=number, worker=worker, started_at=started_at, outcome=outcome
    )
    attempt._state.adding, attempt._state.db = False, job._state.db
    attempt.db_now = db_now
    return attempt


@functools.cache
def _own_verdict_statement() -> str:
    own = rules.literal_sql(rules.OWN_VERDICT, Job, quote=_q, now="clock_timestamp()")
    order = f"COALESCE(lease_expires_at, {rules.waiting_since_sql()})"
    return _compact(
        f"""SELECT id FROM {_q(Job._meta.db_table)} WHERE queue = %s AND {own}
        ORDER BY {order}, id LIMIT 1 FOR UPDATE SKIP LOCKED"""
    )


def decide_own_verdict(queue: str, worker: str, *, lease: float, bound: int) -> Claim | None:
    """The queue's longest-due job that needs its own verdict (a lease that ran out: it
    is reclaimed; a spent budget: it is buried), decided under its row lock by the
    engine (``verdict.decide``); None when there is none."""
    with clock.worker_transaction():
        with connection.cursor() as cursor:
            cursor.execute(_own_verdict_statement(), [queue])
            row = cursor.fetchone()
        if row is None:
            return None
        job = Job.objects.annotate(db_now=Now(), flow_ruled=rules.flow_ruled_q()).get(pk=row[0])
        return verdict.decide(job, worker, job.db_now, lease=lease, bound=bound, swapped=False)


@functools.cache
def _effect_statement() -> str:
    due = rules.literal_sql(rules.EFFECT_RELEASABLE, Effect, quote=_q, now="clock_timestamp()")
    order = "COALESCE(next_attempt_at, lease_expires_at, created_at)"
    return _compact(
        f"""SELECT id FROM {_q(Effect._meta.db_table)} WHERE {due}
        ORDER BY {order}, id LIMIT 1 FOR UPDATE SKIP LOCKED"""
    )


def claim_effect(worker: str, *, look_first: bool = False) -> tuple[Effect, str] | None:
    """Lease the ledger's longest-due releasable effect to ``worker`` (pending or unknown
    and due, or sending whose lease ran out): the effect and its state before, or None
    when none is due. Picked under its row lock (another cluster passes over it) and
    leased by the ledger's own arrow (``effect_machine.claim_send``) in one transaction;
    an effect whose send budget is spent goes to ``needs_review`` here, and the next due
    one is looked at. ``look_first`` (an idle cluster's look): the pick alone, outside a
    transaction, first; none due costs that one statement, not four."""
    from jobs.engine import effect_machine

    if look_first:
        with connection.cursor() as cursor:
            cursor.execute(_effect_statement())
            if cursor.fetchone() is None:
                return None
    for _ in range(4):
        with clock.worker_transaction():
            with connection.cursor() as cursor:
                cursor.execute(_effect_statement())
                row = cursor.fetchone()
            if row is None:
                return None
            effect = Effect.objects.select_related("job").get(pk=row[0])
            prior = effect.state
            if effect_machine.claim_send(effect, worker) == "claimed":
                return effect, prior
    return None
