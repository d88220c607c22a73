"""The history section's databases and their load (``bench.history``, issue 46).

N finished jobs are written by COPY, ``CHUNK`` jobs a round, each with its attempts and,
when it succeeded, its settled effect, in the shapes the engine writes (2% dead after 5
attempts, 2% failed). A tenth of them (the "day" the retention pass removes) finished just
over the archive window ago, the rest inside it. The indexes stay as migrated (rows arrive
in key order); foreign-key triggers are off for the load only; VACUUM ANALYZE after.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from bench import infra

DAY = 86400.0
CHUNK = 250_000  # jobs a COPY round (jobs, then their attempts, then their effects)
TENANTS = 50
KIND = "demo.summary"
TABLES = ("jobs_job", "jobs_attempt", "jobs_effect")

JOB_COLUMNS = [
    "id", "kind", "uid", "keys_from_id", "tenant_key", "subject_type", "subject_id",
    "output_revision", "params", "state", "version", "attempts", "max_attempts",
    "lease_owner", "last_error_class", "last_error_code", "last_error_detail",
    "created_at", "updated_at", "started_at", "finished_at",
]  # fmt: skip
ATTEMPT_COLUMNS = [
    "id", "job_id", "number", "worker", "started_at", "finished_at", "outcome",
    "error_class", "error_code",
]  # fmt: skip
EFFECT_COLUMNS = [
    "id", "effect_id", "job_id", "name", "provider", "recipient", "idempotency_key", "data",
    "state", "version", "attempts", "max_attempts", "lease_owner", "provider_ref", "reason",
    "last_error_class", "last_error_code", "created_at", "updated_at", "applied_at",
]  # fmt: skip


# --- the database ----------------------------------------------------------------------


@contextlib.contextmanager
def use_database(name: str) -> Iterator[None]:
    """Point this process's default connection at ``name`` (every thread's, as each
    connects from the same settings dict), and back afterwards."""
    from django.conf import settings
    from django.db import connections

    db = settings.DATABASES["default"]
    before = db["NAME"]
    connections.close_all()
    db["NAME"] = name
    try:
        yield
    finally:
        connections.close_all()
        db["NAME"] = before


def prepare() -> int:
    """Make and migrate the history database (default connection already on it); the
    recipient of the same-work jobs' notices."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    user, _ = get_user_model().objects.get_or_create(username="bench-recipient")
    return user.pk


def current() -> str:
    """The database the default connection names now (``use_database``)."""
    from django.db import connection

    return connection.settings_dict["NAME"]


def empty() -> None:
    """Every job and what hangs off it (and the archive's records), ids restarted."""
    with infra.connect(current()) as conn:
        conn.execute("TRUNCATE jobs_job, jobs_archivedjob, django_q_ormq RESTART IDENTITY CASCADE")


@dataclass
class Plan:
    """Where each loaded job's finish time falls: the oldest ``day`` rows in the day just
    past the window, the rest spread over the window up to an hour ago."""

    n: int
    window: float  # days
    now: float = field(default_factory=time.time)

    @property
    def day(self) -> int:
        return self.n // 10

    def finished(self, i: int) -> float:
        if i <= self.day:
            return self.now - (self.window + 1) * DAY + (i - 1) / max(1, self.day) * DAY * 0.99
        rest = max(1, self.n - self.day)
        start = self.now - self.window * DAY + 3600
        return start + (i - self.day - 1) / rest * (self.window * DAY - 7200)


def _uid(i: int) -> str:
    return f"00000000-0000-4000-8000-{i:012x}"


def _rows(plan: Plan, start: int, end: int) -> tuple[list[str], list[str], list[str]]:
    """COPY lines of jobs [start, end), their attempts and effects (ids = job id, attempts
    numbered by the caller's offset: a dead job has five)."""
    from bench.ledger import _ts_epoch
    from jobs.engine.effect_machine import idempotency_key

    jobs, attempts, effects = [], [], []
    for i in range(start, end):
        finished = plan.finished(i)
        created = _ts_epoch(finished - 3.0)
        started = _ts_epoch(finished - 1.5)
        done = _ts_epoch(finished)
        worker = f"host-{i % 3}:{4000 + i % 7}:w{i % 2}"
        if i % 50 == 0:
            state, tries, err = "dead", 5, ("unknown", "RuntimeError")
        elif i % 50 == 1:
            state, tries, err = "failed", 1, ("validation", "rejected")
        else:
            state, tries, err = "succeeded", 1, ("", "")
        uid = _uid(i)
        jobs.append(
            f"{i}\t{KIND}\t{uid}\tf\toffice-{i % TENANTS}\tbench.history\t{i}\t1\t"
            f'{{"notify_user_id": 1}}\t{state}\t{2 * tries + 1}\t{tries}\t5\t{worker}\t'
            f"{err[0]}\t{err[1]}\t\t{created}\t{done}\t{started}\t{done}"
        )
        for number in range(1, tries + 1):
            outcome = state if number == tries else "retry"
            a_err = err if outcome != "succeeded" else ("", "")
            attempts.append(
                f"{i}\t{number}\t{worker}\t{started}\t{done}\t{outcome}\t{a_err[0]}\t{a_err[1]}"
            )
        if state == "succeeded":
            recipient = 1 + i % 40
            effect_id = f"{uid}:1:completion-notice:{recipient}"
            effects.append(
                f"{i}\t{effect_id}\t{i}\tcompletion-notice\twebhook\t{recipient}\t"
                f"{idempotency_key(effect_id)}\t{{}}\tapplied\t2\t1\t8\t\tntc_{i:016x}\t\t\t\t"
                f"{done}\t{done}\t{done}"
            )
    return jobs, attempts, effects


def load(plan: Plan, progress: Callable[[str], None]) -> float:
    """COPY ``plan.n`` finished jobs with their rows, ``CHUNK`` jobs a round; seconds."""
    from bench.ledger import _copy

    t0 = time.perf_counter()
    attempt_id = 0
    with infra.connect(current()) as conn:
        # A bench database only: no deferred FK trigger queue for millions of rows.
        conn.execute("SET session_replication_role = replica")
        for start in range(1, plan.n + 1, CHUNK):
            end = min(plan.n + 1, start + CHUNK)
            jobs, attempts, effects = _rows(plan, start, end)
            numbered = []
            for line in attempts:
                attempt_id += 1
                numbered.append(f"{attempt_id}\t{line}")
            _copy(conn, "jobs_job", JOB_COLUMNS, jobs)
            _copy(conn, "jobs_attempt", ATTEMPT_COLUMNS, numbered)
            _copy(conn, "jobs_effect", EFFECT_COLUMNS, effects)
            if (end - 1) % 1_000_000 == 0 or end > plan.n:
                progress(f"history: {end - 1:,} of {plan.n:,} jobs loaded")
        conn.execute("SET session_replication_role = origin")
        for table in TABLES:
            conn.execute(
                f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                f"greatest(1, (SELECT max(id) FROM {table})))"
            )
            conn.execute(f"VACUUM ANALYZE {table}")
    return time.perf_counter() - t0


def table_bytes() -> dict[str, tuple[int, int]]:
    """(total with TOAST and indexes, indexes) bytes of each table."""
    with infra.connect(current()) as conn:
        return {
            t: tuple(
                conn.execute(
                    "SELECT pg_total_relation_size(%s::regclass), pg_indexes_size(%s::regclass)",
                    [t, t],
                ).fetchone()
            )
            for t in TABLES
        }
