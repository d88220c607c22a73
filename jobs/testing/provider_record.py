"""The stand-in provider's own record (``jobs.testing.fakeprovider``): its schema, and the
reader tests, ``manage.py burst`` and operators use to learn what the provider really saw.

A SQLite file apart from the Django database under test, written by the stand-in (each
write committed before its answer leaves) and readable by any process at any time.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

LOOKUP_PATH = "/notices/{key}"  # how lookups are filed in the record
LIST_PATH = "/notices?list"  # how listings (GET /notices?since=...) are filed

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    n INTEGER PRIMARY KEY,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    received_at REAL NOT NULL,
    read_at REAL,
    answered_at REAL NOT NULL,
    idempotency_key TEXT NOT NULL DEFAULT '',
    effect_id TEXT NOT NULL DEFAULT '',
    body_sha256 TEXT NOT NULL DEFAULT '',
    status INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    send_id TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS sends (
    n INTEGER PRIMARY KEY,
    idempotency_key TEXT NOT NULL UNIQUE,
    send_id TEXT NOT NULL UNIQUE,
    effect_id TEXT NOT NULL,
    recipient TEXT NOT NULL,
    body_sha256 TEXT NOT NULL,
    body TEXT NOT NULL,
    applied_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    n INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    what TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_key ON requests (idempotency_key);
CREATE INDEX IF NOT EXISTS sends_effect ON sends (effect_id);
"""


def _connect(path: Path | str) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.executescript(SCHEMA)
    return conn


def body_sha256(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Record:
    """Read the provider's own record (any process, any time, also while it runs)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    def _rows(self, sql: str, params=()) -> list[sqlite3.Row]:
        conn = _connect(self.path)
        try:
            conn.row_factory = sqlite3.Row
            return list(conn.execute(sql, params))
        finally:
            conn.close()

    def requests(self, *, path: str = "/notices") -> list[dict]:
        return [
            dict(r) for r in self._rows("SELECT * FROM requests WHERE path = ? ORDER BY n", [path])
        ]

    def sends(self) -> list[dict]:
        return [dict(r) for r in self._rows("SELECT * FROM sends ORDER BY n")]

    def events(self) -> list[dict]:
        return [dict(r) for r in self._rows("SELECT * FROM events ORDER BY n")]

    def requests_for(self, idempotency_key: str) -> list[dict]:
        """The sends (POSTs) under ``idempotency_key``; lookups are counted apart."""
        return [r for r in self.requests() if r["idempotency_key"] == idempotency_key]

    def lookups(self) -> list[dict]:
        """Every lookup (``GET /notices/{key}``), with its key and status."""
        return self.requests(path=LOOKUP_PATH)

    def lookups_for(self, idempotency_key: str) -> list[dict]:
        return [r for r in self.lookups() if r["idempotency_key"] == idempotency_key]

    def sends_by_effect(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for send in self.sends():
            out.setdefault(send["effect_id"], []).append(send)
        return out

    def duplicate_effects(self) -> dict[str, int]:
        """Effect ids applied more than once (under different keys): must stay empty."""
        return {e: len(s) for e, s in self.sends_by_effect().items() if len(s) > 1}

    def max_in_flight(self, *, since: float | None = None) -> int:
        """The most notice calls the provider held open at one instant."""
        edges = []
        for r in self.requests():
            if since is not None and r["answered_at"] < since:
                continue
            edges.append((r["received_at"], 1))
            edges.append((r["answered_at"], -1))
        # At equal times an answer ends before a new call starts (the answer was
        # timed before it was written, so a later call cannot precede it).
        edges.sort(key=lambda e: (e[0], e[1]))
        peak = now = 0
        for _, step in edges:
            now += step
            peak = max(peak, now)
        return peak

    def calls_per_second(self, *, origin: float) -> list[tuple[int, int]]:
        """(second after ``origin``, notice calls received in it), gaps filled with 0."""
        counts: dict[int, int] = {}
        for r in self.requests():
            second = int((r["received_at"] - origin) // 1)
            counts[second] = counts.get(second, 0) + 1
        if not counts:
            return []
        return [(s, counts.get(s, 0)) for s in range(min(counts), max(counts) + 1)]

    def last_event_at(self, what: str) -> float | None:
        at = [e["at"] for e in self.events() if e["what"].split(" ", 1)[0] == what]
        return at[-1] if at else None
