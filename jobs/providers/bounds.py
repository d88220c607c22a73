"""In-flight slots: at most N calls to one provider at once, across every process.

A sender takes one of the provider's slots before it calls and gives it back after
the call returned (or timed out). A slot is a lock that the operating system or the
database drops when its holder dies, so a crashed worker never leaks a slot and no
lease has to expire first.

The bound is a count, not a range of slot numbers: every provider has one fixed slot
space (indexes ``0..SLOT_SPACE-1``), and a sender takes a free slot only while fewer
than ``limit`` slots of the whole space are held. So lowering a bound binds at once:
from 4 to 1, a new sender waits while the calls holding slots 1-3 are still running,
and the gauge (``in_flight_now``, read by the console and ``/metrics``) counts those
very slots. "Count the held slots, then take a free one" runs under a short gate per
provider, so two senders never both see the last free place.

- PostgreSQL: a slot is a session-level advisory lock ``pg_try_advisory_lock(key)``,
  one key per (provider, slot), held by the worker's database session between two
  statements, never inside a transaction, so no row stays locked during the HTTP
  call. One statement takes the gate (a transaction-level advisory lock, released
  when the statement's transaction ends), counts the provider's held slots in
  ``pg_locks`` and takes the lowest free one.
- SQLite (the single-host demo): ``flock`` on small files next to the database, one
  per slot, counted and taken under an ``flock`` on the provider's gate file. Every
  process on the host sees the same files.

Waiting for a slot polls with growing, jittered sleeps so that many waiting
workers do not retry in step; after ``JOBS_PROVIDER_SLOT_WAIT_SECONDS`` the
sender gives up and the effect is deferred without spending an attempt.
"""

from __future__ import annotations

import logging
import os
import random
import re
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from django.db import connection

from jobs import conf

log = logging.getLogger("jobs.bounds")

try:  # POSIX only; without it the SQLite demo runs unbounded (logged once).
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

# Slot indexes take the low 16 bits of a key; the last index is the provider's gate.
_MAX_SLOTS = 1 << 16
GATE_INDEX = _MAX_SLOTS - 1
SLOT_SPACE = GATE_INDEX  # every provider's slots: 0..SLOT_SPACE-1, whatever its bound


class Slot:
    """One held slot; ``release()`` gives it back (idempotent)."""

    def __init__(self, provider: str, index: int, release: Callable[[], None] | None) -> None:
        self.provider = provider
        self.index = index
        self._release = release

    def release(self) -> None:
        """Give the slot back (a second call does nothing)."""
        if self._release is not None:
            release, self._release = self._release, None
            release()


def _provider_hash(provider: str) -> int:
    return zlib.crc32(f"jobs.provider-slot:{provider}".encode())


def slot_key(provider: str, index: int) -> int:
    """The advisory-lock key of one slot: a provider hash in the high bits, the slot below."""
    return (_provider_hash(provider) << 16) | index


def _check(limit: int) -> None:
    if not 0 < limit < _MAX_SLOTS:
        raise ValueError(f"an in-flight limit must be between 1 and {SLOT_SPACE}")


# --- PostgreSQL ----------------------------------------------------------------------

# A bigint advisory key shows in pg_locks as classid (its high 32 bits) and objid (the
# low 32), objsubid 1. Advisory locks belong to one database: another database's slots
# are not ours. A provider's keys share classid and objid's high half; the slot index
# is objid's low half.
_HELD = (
    "SELECT (l.objid::bigint & 65535)::int AS idx FROM pg_locks l"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND l.classid::bigint = %(high)s AND (l.objid::bigint >> 16) = %(mid)s"
    " AND (l.objid::bigint & 65535) <> %(gate_index)s"
)

# The gate row comes first (a materialized CTE that takes the transaction-level gate
# lock); the count reads pg_locks in a LATERAL subquery that depends on that row, so
# it cannot run before the gate is held; the take depends on the count. All in one
# statement: in autocommit the gate is released as the statement's transaction ends.
# Inside a transaction (a caller's atomic block) the gate is a session lock instead,
# given back by the next statement, so it is not held until that transaction ends.
_TAKE = """
WITH gate AS MATERIALIZED (
    SELECT {gate_lock}(%(gate)s)::text AS taken
), held AS MATERIALIZED (
    SELECT h.n, h.taken_idx
    FROM gate, LATERAL (
        SELECT count(*) AS n, coalesce(array_agg(s.idx), '{{}}') AS taken_idx
        FROM ({held}) s WHERE gate.taken IS NOT NULL
    ) h
), free AS MATERIALIZED (  -- n held: one of 0..n is free
    SELECT held.n, (
        SELECT min(i) FROM generate_series(0, least(held.n, %(space)s - 1)) i
        WHERE i <> ALL(held.taken_idx)
    ) AS idx
    FROM held
)
SELECT free.idx,
       CASE WHEN free.n < %(limit)s AND free.idx IS NOT NULL
            THEN pg_try_advisory_lock(%(base)s + free.idx) ELSE false END
FROM free
"""


def _key_parts(provider: str) -> dict[str, int]:
    base = _provider_hash(provider) << 16
    return {
        "base": base,
        "high": base >> 32,
        "mid": (base & 0xFFFFFFFF) >> 16,
        "gate": base | GATE_INDEX,
        "gate_index": GATE_INDEX,
        "space": SLOT_SPACE,
    }


_TAKE_AUTOCOMMIT = _TAKE.format(gate_lock="pg_advisory_xact_lock", held=_HELD)
_TAKE_IN_TRANSACTION = _TAKE.format(gate_lock="pg_advisory_lock", held=_HELD)


def _try_pg(provider: str, limit: int) -> Slot | None:
    parts = _key_parts(provider)
    with connection.cursor() as cursor:
        if connection.in_atomic_block:
            try:
                cursor.execute(_TAKE_IN_TRANSACTION, {**parts, "limit": limit})
                index, won = cursor.fetchone()
            finally:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [parts["gate"]])
        else:
            cursor.execute(_TAKE_AUTOCOMMIT, {**parts, "limit": limit})
            index, won = cursor.fetchone()
    if not won:
        return None
    key = slot_key(provider, index)

    def release() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
            (still_held,) = cursor.fetchone()
        if not still_held:  # the session was replaced while we held it
            log.warning("provider=%s slot=%s was lost before release", provider, index)

    return Slot(provider, index, release)


def _held_pg(provider: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM ({_HELD}) s", _key_parts(provider))
        return cursor.fetchone()[0]


# --- files (SQLite) ------------------------------------------------------------------


def slot_dir() -> Path:
    """Where the SQLite demo keeps its slot files: next to the database file."""
    configured = conf.get("JOBS_PROVIDER_SLOT_DIR")
    if configured:
        return Path(configured)
    name = str(connection.settings_dict.get("NAME") or "")
    if connection.vendor == "sqlite" and name and "memory" not in name and name != ":memory:":
        return Path(name + ".provider-slots")
    # An in-memory database lives in one process: a per-process folder is enough.
    return Path(tempfile.gettempdir()) / f"jobs-provider-slots-{os.getpid()}"


def _safe(provider: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in provider)


def _lock_file(path: Path, *, blocking: bool) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None when another holds it.

    flock locks belong to the open file description: two opens in one process
    exclude each other too, so threads are bounded as well.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlock_file(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _held_files(folder: Path, safe: str) -> set[int]:
    """The slot indexes of ``safe``'s files that someone holds now."""
    pattern = re.compile(rf"{re.escape(safe)}\.(\d+)\.lock")
    held = set()
    for entry in os.listdir(folder):
        found = pattern.fullmatch(entry)
        if found is None:
            continue
        fd = _lock_file(folder / entry, blocking=False)
        if fd is None:
            held.add(int(found.group(1)))
        else:
            _unlock_file(fd)
    return held


@contextmanager
def _file_gate(provider: str) -> Iterator[tuple[Path, str]]:
    folder = slot_dir()
    folder.mkdir(parents=True, exist_ok=True)
    safe = _safe(provider)
    gate = _lock_file(folder / f"{safe}.gate", blocking=True)
    try:
        yield folder, safe
    finally:
        _unlock_file(gate)


def _try_file(provider: str, limit: int) -> Slot | None:
    with _file_gate(provider) as (folder, safe):
        held = _held_files(folder, safe)
        if len(held) >= limit:
            return None
        index = min(i for i in range(len(held) + 1) if i not in held)
        fd = _lock_file(folder / f"{safe}.{index}.lock", blocking=False)
    if fd is None:  # pragma: no cover - a holder outside the gate (an older version)
        return None
    return Slot(provider, index, lambda: _unlock_file(fd))


# --- the contract ----------------------------------------------------------------------

_warned_unbounded = False


def try_acquire(provider: str, limit: int) -> Slot | None:
    """Take a free slot of ``provider`` now, or None while ``limit`` or more are held."""
    global _warned_unbounded
    _check(limit)
    if connection.vendor == "postgresql":
        return _try_pg(provider, limit)
    if fcntl is not None:
        return _try_file(provider, limit)
    if not _warned_unbounded:  # pragma: no cover - Windows demo
        log.warning("no file locks on this platform: provider bounds are not enforced")
        _warned_unbounded = True
    return Slot(provider, 0, None)  # pragma: no cover


def acquire(provider: str, limit: int, *, wait: float) -> Slot | None:
    """Take a slot, waiting up to ``wait`` seconds with jittered polls; None if none freed."""
    deadline = time.monotonic() + max(0.0, wait)
    pause = 0.005
    while True:
        slot = try_acquire(provider, limit)
        if slot is not None:
            return slot
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        # Full jitter on a growing window: waiters do not wake together.
        time.sleep(min(left, random.uniform(0, pause)))
        pause = min(0.2, pause * 2)


@contextmanager
def in_flight(provider: str, limit: int | None, *, wait: float) -> Iterator[Slot | None]:
    """Hold one slot of ``provider`` for the body; yields None when none freed in time.

    ``limit`` None means unbounded: a dummy slot is yielded.
    """
    if not limit:
        yield Slot(provider, 0, None)
        return
    slot = acquire(provider, limit, wait=wait)
    try:
        yield slot
    finally:
        if slot is not None:
            slot.release()


def in_flight_now(provider: str, limit: int | None = None) -> int:
    """How many of ``provider``'s slots are held right now (a gauge; may be stale at once).

    Every held slot of the provider counts, whatever bound was in force when it was
    taken: the very count a sender compares with the bound. ``limit`` is accepted
    for the callers that pass it and no longer narrows the count.
    """
    if connection.vendor == "postgresql":
        return _held_pg(provider)
    if fcntl is None:  # pragma: no cover - Windows demo
        return 0
    folder = slot_dir()
    if not folder.is_dir():
        return 0
    return len(_held_files(folder, _safe(provider)))
