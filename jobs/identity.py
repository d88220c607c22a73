"""Identities no failover can hand out twice: a job's uid, and what derives from it.

A job's id comes from a sequence, and a promoted asynchronous replica resumes that
sequence below what the lost primary had used: a new job can get a lost job's id. So
nothing that leaves the database (an idempotency key, an artifact key or object name,
an effect id in a provider's body) derives from the id. Each job gets a uid when its
row is made (``Job.uid``, a time-ordered UUIDv7 from this module), and every key and
name derives from it (``job_key``). The id stays the row's handle and the readable
display name (``job-84-rev-29``).

Jobs made before migration 0024 keep the keys they had (``Job.keys_from_id``): their
keys derive from the id, as before, so a key already sent to a provider or an object
already in the bucket is named the same way after the upgrade.

This module imports nothing from the app: the model's default lives here.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from django.db.models import Q

# The 48 bits of a UUIDv7's timestamp, and its random parts (RFC 9562, section 5.7).
_MS_MASK = (1 << 48) - 1
_RAND_B_BITS = 62


def uuid7(at_ms: int | None = None) -> uuid.UUID:
    """A time-ordered UUID (version 7): 48 bits of Unix milliseconds, 74 random bits.

    Time first keeps new ids at the right edge of their index (a random UUIDv4 would
    write all over it); the 74 random bits keep two hosts in the same millisecond apart.
    ``at_ms`` dates one made for an older row (the migration dates them by
    ``created_at``).
    """
    ms = time.time_ns() // 1_000_000 if at_ms is None else int(at_ms)
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits; 74 used
    rand_a = rand >> 68  # 12 bits
    rand_b = rand & ((1 << _RAND_B_BITS) - 1)
    value = (ms & _MS_MASK) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
    return uuid.UUID(int=value)


def made_at(uid: uuid.UUID) -> datetime | None:
    """When a UUIDv7 was made (its milliseconds), or None for another version."""
    if uid.version != 7:
        return None
    return datetime.fromtimestamp((uid.int >> 80) / 1000, tz=UTC)


# A lost job's uid that ``jobs_reconcile`` asks for again (``restoring``): taken by the
# next row made in this context, once.
_RESTORING: ContextVar[list[uuid.UUID] | None] = ContextVar("jobs_restoring_uid", default=None)


def new_uid() -> uuid.UUID:
    """``Job.uid``'s default: made once, when the row is made (or the lost job's own,
    once, inside ``restoring``)."""
    pending = _RESTORING.get()
    if pending:
        return pending.pop()
    return uuid7()


@contextmanager
def restoring(uid: uuid.UUID) -> Iterator[None]:
    """Let the next job row made in this context take ``uid``, a lost job's (issue 47).

    For ``jobs.reconcile`` only: a job a failover lost is asked for again under the uid
    the outside world knows it by (its objects, its notices' keys), so every key derives
    as before. The uid's unique constraint still refuses a second row with it."""
    token = _RESTORING.set([uid])
    try:
        yield
    finally:
        _RESTORING.reset(token)


def job_key(job: Any) -> str:
    """What the job's keys and object names derive from: its uid; its id for a job made
    before migration 0024 (``keys_from_id``), whose keys stay what they were."""
    return str(job.pk) if job.keys_from_id else str(job.uid)


def display_name(job: Any) -> str:
    """The readable name of a job's output (``job-84-rev-29``): for people, never a key."""
    return f"job-{job.pk}-rev-{job.output_revision}"


_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
# A key or object name of a job's artifact: ``job-<uid>-rev-N`` (``job-<id>-rev-N`` before
# migration 0024), anywhere in a storage name.
KEY_IN_NAME = re.compile(rf"(?:^|/)job-(?P<job>{_UUID}|\d+)-rev-(?P<revision>\d+)")


def tokens_lookup(tokens: set[str], *, id_field: str = "pk") -> Q | None:
    """The filter for the jobs a set of key tokens (``job_key``s: uids, or ids of jobs
    made before migration 0024) name, or None when none is one; ``id_field`` names the
    job's id on the model filtered (``job_id`` on an archived job's record)."""
    ids = {int(t) for t in tokens if t.isdigit()}
    uids = set()
    for t in tokens:
        if not t.isdigit():
            try:
                uids.add(uuid.UUID(t))
            except ValueError:
                continue
    if not ids and not uids:
        return None
    return Q(**{f"{id_field}__in": ids, "keys_from_id": True}) | Q(uid__in=uids)


def job_lookup(name: str) -> dict[str, Any] | None:
    """The ``Job`` filter for the job a key or object name belongs to, or None.

    A name with a uid finds that job only; one with an id only the job made before
    migration 0024 under that id (a new job that got the same id after a failover
    is another job).
    """
    found = KEY_IN_NAME.search(name)
    if found is None:
        return None
    token = found.group("job")
    if token.isdigit():
        return {"pk": int(token), "keys_from_id": True}
    return {"uid": uuid.UUID(token)}
