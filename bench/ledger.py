"""Ledger and claim lookups at 10k, 100k and 1M rows: the per-lookup time should stay flat.

The ``bench_ledger`` database is filled by COPY with a finished history (jobs
succeeded, effects applied) around a constant active set (queued, running,
waiting and expired jobs; pending, unknown and stuck effects), because the
active set is bounded by throughput while history grows. Each lookup is the
engine's own queryset, run against random keys; ``EXPLAIN`` shows which index
answers it.
"""

from __future__ import annotations

import io
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from django.core.management import call_command
from django.db import connections, transaction
from django.utils import timezone

from bench import infra
from jobs import rules
from jobs.engine.effect_machine import effect_identity, idempotency_key
from jobs.models import Effect, Job

ALIAS = "ledger"
SIZES = (10_000, 100_000, 1_000_000)
TENANTS = 50

JOB_COLUMNS = [
    "id",
    "kind",
    "tenant_key",
    "subject_type",
    "subject_id",
    "output_revision",
    "params",
    "state",
    "version",
    "attempts",
    "max_attempts",
    "next_attempt_at",
    "lease_owner",
    "lease_expires_at",
    "last_error_class",
    "last_error_code",
    "last_error_detail",
    "created_at",
    "updated_at",
    "started_at",
    "finished_at",
    "uid",
    "keys_from_id",
]
EFFECT_COLUMNS = [
    "id",
    "effect_id",
    "job_id",
    "name",
    "provider",
    "recipient",
    "idempotency_key",
    "data",
    "state",
    "version",
    "attempts",
    "max_attempts",
    "next_attempt_at",
    "lease_owner",
    "lease_expires_at",
    "provider_ref",
    "reason",
    "last_error_class",
    "last_error_code",
    "created_at",
    "updated_at",
    "applied_at",
]

N = r"\N"


def _ts(t: datetime) -> str:
    return t.isoformat()


_SECONDS: dict[int, str] = {}


def _ts_epoch(epoch: float) -> str:
    """``_ts`` for the million history rows, without building a datetime per row."""
    whole = int(epoch)
    text = _SECONDS.get(whole)
    if text is None:
        if len(_SECONDS) > 100_000:
            _SECONDS.clear()
        text = _SECONDS[whole] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(whole))
    return f"{text}.{int((epoch - whole) * 1e6):06d}+00"


class _JobRef(NamedTuple):
    pk: int
    output_revision: int
    # History rows stand for jobs made before migration 0024: keys derive from the id.
    keys_from_id: bool = True
    uid: str = ""


def _uid(i: int) -> str:
    """A unique uid per history row (its id in the last 48 bits: fast to write)."""
    return f"00000000-0000-0000-0000-{i:012x}"


class _Shape:
    """Which job ids carry which active state (the rest is finished history)."""

    def __init__(self, now: datetime):
        self.now = now
        self.epoch = now.timestamp()
        # id -> (job state, effect state); all inside the first 10k rows.
        self.jobs = {}
        self.effects = {}
        rng = random.Random(7)
        ids = rng.sample(range(1, SIZES[0] + 1), 400)
        plan = [
            ("queued", 120),  # enqueued, waiting for a worker
            ("queued_due", 10),  # due, not claimed yet
            ("running", 40),
            ("running_expired", 5),
            ("retry_wait", 40),
            ("retry_due", 10),
            ("failed", 15),
            ("dead", 10),
        ]
        it = iter(ids)
        for state, count in plan:
            for _ in range(count):
                self.jobs[next(it)] = state
        eplan = [
            ("pending", 40),  # published, inside the grace window
            ("pending_due", 10),
            ("unknown_due", 5),
            ("sending_expired", 5),
            ("needs_review", 10),
            ("withheld", 10),
        ]
        succeeded = [i for i in range(1, SIZES[0] + 1) if i not in self.jobs]
        it = iter(rng.sample(succeeded, 80))
        for state, count in eplan:
            for _ in range(count):
                self.effects[next(it)] = state


def _created(i: int, shape: _Shape) -> float:
    """History is spread over the last days, two jobs a second, oldest first."""
    return shape.epoch - (SIZES[-1] - i) * 0.5 - 3600


def _history_job_line(i: int, shape: _Shape) -> str:
    """A succeeded job: the fast path for the million history rows."""
    created = _ts_epoch(_created(i, shape))
    finished = _ts_epoch(_created(i, shape) + 2)
    owner = f"bench-host:{1000 + i % 7}:cafe{i % 97:04d}"
    return (
        f"{i}\tdemo.summary\tt{i % TENANTS}\tbench.item\t{i}\t1\t{{}}\tsucceeded\t3\t1\t5\t"
        f"\\N\t{owner}\t\\N\t\t\t\t{created}\t{created}\t{created}\t{finished}"
        f"\t{_uid(i)}\tt"
    )


def _history_effect_line(i: int, shape: _Shape) -> str:
    """An applied in-app notice of a succeeded job (fast path)."""
    epoch = _created(i, shape) + 2
    created, applied = _ts_epoch(epoch), _ts_epoch(epoch + 0.1)
    recipient = 1 + i % 40
    effect_id = effect_identity(_JobRef(i, 1), "completion-notice", str(recipient))
    key = idempotency_key(effect_id)
    return (
        f"{i}\t{effect_id}\t{i}\tcompletion-notice\tinapp\t{recipient}\t{key}\t{{}}\tapplied\t"
        f"2\t1\t8\t\\N\t\t\\N\tnotice:{i}\t\t\t\t{created}\t{created}\t{applied}"
    )


def _job_line(i: int, shape: _Shape) -> str:
    if i not in shape.jobs:
        return _history_job_line(i, shape)
    now = shape.now
    epoch = _created(i, shape)
    created = _ts_epoch(epoch)
    state = shape.jobs.get(i, "succeeded")
    owner = f"bench-host:{1000 + i % 7}:cafe{i % 97:04d}"
    nxt = lease = started = finished = N
    attempts, version, err = 1, 3, ("", "")
    if state == "succeeded":
        started = created
        finished = _ts_epoch(epoch + 2)
        owner_col = owner
    elif state in ("queued", "queued_due"):
        attempts, version, owner_col = 0, 0, ""
        due = now - timedelta(seconds=5)
        nxt = _ts(due)
    elif state in ("running", "running_expired"):
        owner_col, started = owner, _ts(now - timedelta(seconds=10))
        expires = now + timedelta(seconds=600) if state == "running" else now - timedelta(seconds=5)
        lease = _ts(expires)
    elif state in ("retry_wait", "retry_due"):
        owner_col, err = owner, ("temporary", "http_503")
        due = now + timedelta(seconds=600) if state == "retry_wait" else now - timedelta(seconds=1)
        nxt = _ts(due)
    else:  # failed, dead
        owner_col, err = owner, ("validation", "rejected")
        finished = _ts_epoch(epoch + 2)
    real_state = {"queued_due": "queued", "running_expired": "running", "retry_due": "retry_wait"}
    real_state = real_state.get(state, state)
    return "\t".join(
        [
            str(i),
            "demo.summary",
            f"t{i % TENANTS}",
            "bench.item",
            str(i),
            "1",
            '{"notify_user_id": 1}',
            real_state,
            str(version),
            str(attempts),
            "5",
            nxt,
            owner_col,
            lease,
            err[0],
            err[1],
            "",
            created,
            created,
            started,
            finished,
            _uid(i),
            "t",
        ]
    )


def _effect_line(i: int, shape: _Shape) -> str:
    if i not in shape.effects:
        return _history_effect_line(i, shape)
    now = shape.now
    epoch = _created(i, shape) + 2
    created = _ts_epoch(epoch)
    state = shape.effects.get(i, "applied")
    # effect_identity reads only pk and output_revision: no model instance per row.
    effect_id = effect_identity(_JobRef(i, 1), "completion-notice", str(1 + i % 40))
    nxt = lease = applied = N
    owner, ref, reason, attempts = "", "", "", 1
    if state == "applied":
        ref, applied = f"notice:{i}", _ts_epoch(epoch + 0.1)
    elif state == "pending":
        attempts, nxt = 0, _ts(now + timedelta(seconds=600))
    elif state == "pending_due":
        attempts, nxt = 0, _ts(now - timedelta(seconds=2))
    elif state == "unknown_due":
        nxt = _ts(now - timedelta(seconds=2))
    elif state == "sending_expired":
        owner, lease = f"bench-host:1:cafe{i % 97:04d}", _ts(now - timedelta(seconds=3))
    else:
        reason = "bench"
    real_state = state.replace("_due", "").replace("_expired", "")
    return "\t".join(
        [
            str(i),
            effect_id,
            str(i),
            "completion-notice",
            "inapp",
            str(1 + i % 40),
            idempotency_key(effect_id),
            '{"title": "bench"}',
            real_state,
            "2",
            str(attempts),
            "8",
            nxt,
            owner,
            lease,
            ref,
            reason,
            "",
            "",
            created,
            created,
            applied,
        ]
    )


def _copy(conn, table: str, columns: list[str], lines) -> None:
    sql = f"COPY {table} ({', '.join(columns)}) FROM STDIN"
    with conn.cursor() as cur, cur.copy(sql) as copy:
        buf = io.StringIO()
        for n, line in enumerate(lines, 1):
            buf.write(line)
            buf.write("\n")
            if n % 20_000 == 0:
                copy.write(buf.getvalue())
                buf = io.StringIO()
        copy.write(buf.getvalue())


def _secondary_indexes(conn, table: str) -> list[tuple[str, str]]:
    """(drop, create) statements for every index but the primary key, constraints included."""
    out = []
    for name, definition in conn.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = %s::regclass AND contype = 'u'",
        [table],
    ):
        out.append(
            (
                f'ALTER TABLE {table} DROP CONSTRAINT "{name}"',
                f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition}',
            )
        )
    for name, definition in conn.execute(
        "SELECT i.indexname, i.indexdef FROM pg_indexes i WHERE i.tablename = %s "
        "AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)",
        [table],
    ):
        out.append((f'DROP INDEX "{name}"', definition))
    return out


def load(start: int, end: int, shape: _Shape) -> float:
    """COPY jobs and effects with ids in [start, end); returns the seconds it took.

    Like any bulk load, the secondary indexes are dropped first and built again
    afterwards (a sorted build is several times faster than a million random
    inserts on a 2-core machine); the schema ends exactly as migrated.
    """
    t = time.perf_counter()
    with infra.connect(infra.LEDGER_DB) as conn:
        indexes = {t: _secondary_indexes(conn, t) for t in ("jobs_job", "jobs_effect")}
        for statements in indexes.values():
            for drop, _ in statements:
                conn.execute(drop)
        # A bench database only: skip the deferred FK trigger queue of the bulk load.
        conn.execute("SET session_replication_role = replica")
        _copy(conn, "jobs_job", JOB_COLUMNS, (_job_line(i, shape) for i in range(start, end)))
        _copy(
            conn,
            "jobs_effect",
            EFFECT_COLUMNS,
            (_effect_line(i, shape) for i in range(start, end)),
        )
        conn.execute("SET session_replication_role = origin")
        conn.execute("SET maintenance_work_mem = '256MB'")
        for table, statements in indexes.items():
            for _, create in statements:
                conn.execute(create)
            conn.execute(
                f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                f"(SELECT max(id) FROM {table}))"
            )
            # What autovacuum would do (it is off on these machines): stats and visibility map.
            conn.execute(f"VACUUM ANALYZE {table}")
    return time.perf_counter() - t


@dataclass
class Lookup:
    name: str
    make: Callable[[random.Random, datetime], object]  # a queryset or a callable
    keyed: bool = True


@dataclass
class Timing:
    name: str
    rows: int
    orm_us: float  # median per lookup through the ORM, from this process
    server_us: float  # median server execution time (EXPLAIN ANALYZE)
    plan: str  # the scan nodes of the plan
    plan_text: list[str] = field(default_factory=list)


def lookups(size: int) -> list[Lookup]:
    def job_id(rng):
        return rng.randint(1, size)

    def claim_lookup(rng, now):
        # jobs.transitions.claim: the job row by id.
        return Job.objects.using(ALIAS).filter(pk=job_id(rng))

    def tenant_count(rng, now):
        # jobs.transitions.claim: running jobs of the tenant whose lease still holds.
        return (
            Job.objects.using(ALIAS)
            .filter(rules.to_q(rules.LIVE_RUNNING))
            .filter(tenant_key=f"t{rng.randrange(TENANTS)}")
            .exclude(pk=job_id(rng))
        )

    def due_jobs(rng, now):
        # the claim's look for due jobs (jobs.claiming), by the rule alone.
        return (
            Job.objects.using(ALIAS)
            .filter(rules.to_q(rules.JOB_DUE))
            .order_by("next_attempt_at")
            .values_list("pk", "next_attempt_at", "state")[:500]
        )

    def expired_leases(rng, now):
        return (
            Job.objects.using(ALIAS)
            .filter(rules.to_q(rules.JOB_LEASE_EXPIRED))
            .order_by("lease_expires_at")
            .values_list("pk", "lease_expires_at", "state")[:500]
        )

    def effect_by_id(rng, now):
        i = job_id(rng)
        eid = effect_identity(Job(pk=i, output_revision=1), "completion-notice", str(1 + i % 40))
        return Effect.objects.using(ALIAS).filter(effect_id=eid)

    def effects_of_job(rng, now):
        # jobs.ledger.release_for_job: the pending effects the worker just published.
        return (
            Effect.objects.using(ALIAS)
            .filter(job_id=job_id(rng), state=Effect.State.PENDING)
            .select_related("job")
        )

    def due_effects(rng, now):
        # the effect claim's look: pending/unknown effects due.
        return (
            Effect.objects.using(ALIAS)
            .filter(
                state__in=[Effect.State.PENDING, Effect.State.UNKNOWN], next_attempt_at__lte=now
            )
            .order_by("next_attempt_at")
            .values_list("pk", "next_attempt_at", "state")[:500]
        )

    def stuck_sends(rng, now):
        return (
            Effect.objects.using(ALIAS)
            .filter(state=Effect.State.SENDING, lease_expires_at__lte=now)
            .order_by("lease_expires_at")
            .values_list("pk", "lease_expires_at", "state")[:500]
        )

    return [
        Lookup("claim: job by id", claim_lookup),
        Lookup("claim: tenant's live running count", tenant_count),
        Lookup("dispatcher: due jobs", due_jobs, keyed=False),
        Lookup("dispatcher: expired leases", expired_leases, keyed=False),
        Lookup("ledger: effect by effect_id", effect_by_id),
        Lookup("ledger: pending effects of a job", effects_of_job),
        Lookup("dispatcher: due effects", due_effects, keyed=False),
        Lookup("dispatcher: stuck sends", stuck_sends, keyed=False),
    ]


SCAN = re.compile(
    r"(Index Only Scan|Index Scan|Bitmap Index Scan|Seq Scan)(?: Backward)?(?: using (\w+))?"
)


def _plan(qs) -> tuple[str, float, list[str]]:
    text = qs.explain(analyze=True, costs=False, timing=False, summary=True)
    nodes = []
    for kind, index in SCAN.findall(text):
        nodes.append(f"{kind}{' ' + index if index else ''}")
    m = re.search(r"Execution Time: ([\d.]+) ms", text)
    return (
        ", ".join(dict.fromkeys(nodes)),
        float(m.group(1)) * 1000 if m else float("nan"),
        (text.splitlines()),
    )


def time_lookups(size: int, *, repeat: int = 200, seed: int = 1) -> list[Timing]:
    rng = random.Random(seed)
    out = []
    for lookup in lookups(size):
        count_qs = lookup.name.endswith("count")
        n = repeat if lookup.keyed else max(20, repeat // 5)
        samples = []
        for _ in range(n):
            qs = lookup.make(rng, timezone.now())
            t = time.perf_counter()
            qs.count() if count_qs else list(qs)
            samples.append(time.perf_counter() - t)
        server, plan, text = [], "", []
        for _ in range(15):
            plan, us, text = _plan(lookup.make(rng, timezone.now()))
            server.append(us)
        out.append(
            Timing(
                lookup.name,
                size,
                statistics.median(samples) * 1e6,
                statistics.median(server),
                plan,
                text,
            )
        )
    out.append(_time_insert(size, rng, repeat=min(repeat, 100)))
    return out


def _time_insert(size: int, rng: random.Random, *, repeat: int) -> Timing:
    """The ledger's write: insert one new effect (unique effect_id and key), rolled back."""
    job = Job.objects.using(ALIAS).get(pk=rng.randint(1, size))
    samples = []
    with transaction.atomic(using=ALIAS):
        for k in range(repeat):
            eid = effect_identity(job, "bench-extra", f"x{k}-{rng.random()}")
            t = time.perf_counter()
            Effect.objects.using(ALIAS).create(
                effect_id=eid,
                job=job,
                name="bench-extra",
                provider="inapp",
                recipient="1",
                idempotency_key=idempotency_key(eid),
            )
            samples.append(time.perf_counter() - t)
        transaction.set_rollback(True, using=ALIAS)
    return Timing(
        "ledger: insert one effect",
        size,
        statistics.median(samples) * 1e6,
        float("nan"),
        "unique checks in jobs_effect_effect_id_key, jobs_effect_idempotency_key_key",
    )


def prepare() -> None:
    infra.drop_database(infra.LEDGER_DB)
    infra.ensure_database(infra.LEDGER_DB)
    call_command("migrate", database=ALIAS, verbosity=0, interactive=False)


def run(sizes=SIZES, *, repeat: int = 200, progress=print) -> tuple[list[Timing], dict]:
    """Grow the ledger through ``sizes`` and time every lookup at each size."""
    prepare()
    shape = _Shape(datetime.now(UTC))
    timings, loads = [], {}
    loaded = 0
    for size in sizes:
        seconds = load(loaded + 1, size + 1, shape)
        loads[size] = seconds
        loaded = size
        progress(f"ledger: {size:,} jobs + {size:,} effects loaded in {seconds:.1f}s")
        timings += time_lookups(size, repeat=repeat)
    connections[ALIAS].close()
    return timings, loads
