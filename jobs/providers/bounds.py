"""In-flight slots: at most N calls to one provider at once, across every process.

A sender takes one of the provider's N slots before it calls and gives it back
after the call returned (or timed out). A slot is a lock that the operating
system or the database drops when its holder dies, so a crashed worker never
leaks a slot and no lease has to expire first.

- PostgreSQL: session-level advisory locks ``pg_try_advisory_lock(key)``, one key
  per (provider, slot). They are held by the worker's database session between
  two statements, never inside a transaction, so no row stays locked during the
  HTTP call.
- SQLite (the single-host demo): ``flock`` on N small files next to the
  database. Every process on the host sees the same files.

Waiting for a slot polls with growing, jittered sleeps so that many waiting
workers do not retry in step; after ``JOBS_PROVIDER_SLOT_WAIT_SECONDS`` the
sender gives up and the effect is deferred without spending an attempt.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.db import connection

from jobs import conf

log = logging.getLogger("jobs.bounds")

try:  # POSIX only; without it the SQLite demo runs unbounded (logged once).
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

_MAX_SLOTS = 1 << 16


class Slot:
    """One held slot; ``release()`` gives it back (idempotent)."""

    def __init__(self, provider: str, index: int, release) -> None:
        self.provider = provider
        self.index = index
        self._release = release

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()


def slot_key(provider: str, index: int) -> int:
    """The advisory-lock key of one slot: a provider hash in the high bits, the slot below."""
    return (zlib.crc32(f"jobs.provider-slot:{provider}".encode()) << 16) | index


# Advisory locks are re-entrant within one database session: remember which keys
# each session holds, so a second take in the same session is not a second slot.
_session_keys: set[tuple[int, int]] = set()
_session_lock = threading.Lock()


def _try_pg(provider: str, index: int) -> Slot | None:
    key = slot_key(provider, index)
    connection.ensure_connection()
    held = (id(connection.connection), key)
    with _session_lock:
        if held in _session_keys:
            return None
        _session_keys.add(held)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
            (won,) = cursor.fetchone()
    except BaseException:
        with _session_lock:
            _session_keys.discard(held)
        raise
    if not won:
        with _session_lock:
            _session_keys.discard(held)
        return None

    def release() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
                (still_held,) = cursor.fetchone()
        finally:
            with _session_lock:
                _session_keys.discard(held)
        if not still_held:  # the session was replaced while we held it
            log.warning("provider=%s slot=%s was lost before release", provider, index)

    return Slot(provider, index, release)


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


def _try_file(provider: str, index: int) -> Slot | None:
    folder = slot_dir()
    folder.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in provider)
    fd = os.open(folder / f"{safe}.{index}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        # flock locks belong to the open file description: two opens in one
        # process exclude each other too, so threads are bounded as well.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None

    def release() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    return Slot(provider, index, release)


_warned_unbounded = False


def try_acquire(provider: str, limit: int) -> Slot | None:
    """Take any free slot of ``provider`` now, or None when all ``limit`` are held."""
    global _warned_unbounded
    if not 0 < limit < _MAX_SLOTS:
        raise ValueError(f"an in-flight limit must be between 1 and {_MAX_SLOTS - 1}")
    if connection.vendor == "postgresql":
        attempt = _try_pg
    elif fcntl is not None:
        attempt = _try_file
    else:  # pragma: no cover - Windows demo
        if not _warned_unbounded:
            log.warning("no file locks on this platform: provider bounds are not enforced")
            _warned_unbounded = True
        return Slot(provider, 0, None)
    # Start at a random slot so waiters spread instead of all probing slot 0.
    start = random.randrange(limit)
    for step in range(limit):
        slot = attempt(provider, (start + step) % limit)
        if slot is not None:
            return slot
    return None


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


def in_flight_now(provider: str, limit: int) -> int:
    """How many of ``provider``'s slots are held right now (a gauge; may be stale at once)."""
    if connection.vendor == "postgresql":
        keys = [slot_key(provider, i) for i in range(limit)]
        with connection.cursor() as cursor:
            # A bigint advisory key is stored as classid (high 32 bits) and objid (low 32).
            # Advisory locks belong to one database: another database's slots are not ours.
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = ANY(%s)",
                [keys],
            )
            return cursor.fetchone()[0]
    if fcntl is None:  # pragma: no cover - Windows demo
        return 0
    held = 0
    for index in range(limit):
        slot = _try_file(provider, index)
        if slot is None:
            held += 1
        else:
            slot.release()
    return held
