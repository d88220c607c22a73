"""Sequences: the jobs of one key start one at a time, in request order, each once the
job before it has ended and its effects have settled (docs/app/sequences.md).

A sequenced job (``@jobs.kind(sequence=...)`` or ``jobs.request(..., sequence_key=...)``)
is written held (``Job.held_by`` = ``SEQUENCE_HELD``): outside the claim's partial
indexes, so the plain claim neither reads nor pays for it. Its key's **head** (the
lowest id held) is released to the claim when the job before it in request order
passes (``rules.SEQUENCE_PASSES``: ended, not a failure that holds the sequence, none
of its effects pending, sending or unknown). One rule, judged in two places:

- right after the job before it moves (a delivery's end, a send's outcome, an
  operator's action: ``moved``), for that key alone;
- by the claim itself (``pgclaim.release_heads`` / ``ormclaim.release_heads``) when its
  queue has nothing claimable, and once a second while busy (``jobs.claiming``): a
  look over the held heads, one index probe per blocked key, never a key's backlog. A
  worker killed between a commit and ``moved`` leaves nothing stuck.

Request order is id order: a request takes its key's lock (PostgreSQL: a transaction
advisory lock; SQLite: the write lock of ``BEGIN IMMEDIATE``) before it inserts, so one
key's ids are handed out in commit order and no item can be overtaken by one asked for
after it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, connection, transaction
from django.db.models.functions import Now

from jobs import queue, rules
from jobs.models import SEQUENCE_HELD, Effect, Job

log = logging.getLogger("jobs.sequences")

KEY_MAX = 200  # Job.sequence_key's length: a longer key is stored as its hash
# The advisory lock class (with the key's hashtext) a request of a sequenced job holds
# until it commits: one key's ids, its request order, are handed out in commit order.
SEQUENCE_LOCK_CLASS = 1785684598
_HELD = {"held_by": SEQUENCE_HELD, "state": Job.State.QUEUED}

SequenceKey = Callable[[dict, tuple[str, str]], str]


def key_of(
    sequence: SequenceKey | None, explicit: str | None, params: dict, subject: tuple[str, str]
) -> str:
    """A request's sequence key: ``explicit`` (``sequence_key=``), else the kind's
    ``sequence(params, subject)``, else "" (not sequenced)."""
    if explicit is None and sequence is None:
        return ""
    own = explicit if explicit is not None else sequence(dict(params), subject)
    if not isinstance(own, str) or not own:
        raise ValueError("a sequence key must be a non-empty string")
    if len(own) > KEY_MAX:
        own = f"#{hashlib.sha256(own.encode()).hexdigest()}"
    return own


def obtain(
    identity: dict[str, Any], defaults: dict[str, Any], *, key: str, skip: bool
) -> tuple[Job, bool]:
    """The one job of ``identity`` and whether this call created it; a new one joins the
    end of ``key``'s sequence, held unless it is the head and may start now."""
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [SEQUENCE_LOCK_CLASS, key]
                )
        job, created = Job.objects.get_or_create(
            **identity,
            defaults={**defaults, "sequence_key": key, "sequence_skip": skip, **_HELD},
        )
        if created and not advance(key):
            # Held. The job before it may end before this commits, its look missing this
            # row: the NOTIFY wakes an idle cluster, whose claim looks at the heads.
            queue.enqueue_jobs([job], due_now=False)
        if created:
            job.refresh_from_db(fields=["next_attempt_at", "held_by", "updated_at"])
    return job, created


def passed(key: str, head_pk: int) -> bool:
    """Whether the job before ``head_pk`` in ``key``'s sequence lets it start: none, or
    one that passed (``rules.SEQUENCE_PASSES``) with no unsettled effect."""
    before = Job.objects.filter(sequence_key=key, pk__lt=head_pk).order_by("-pk").first()
    if before is None:
        return True
    if not rules.holds(rules.SEQUENCE_PASSES, before, now=None):
        return False
    return not Effect.objects.filter(rules.to_q(rules.EFFECT_UNSETTLED), job=before).exists()


def advance(key: str) -> int:
    """Release ``key``'s head to the claim when the job before it passed; 1 if released.
    On PostgreSQL one statement (``pgclaim.release_heads``): every sequenced delivery's
    end asks, most of the time of a key with nothing held."""
    from jobs import executors

    if executors.current().name == "postgres":
        from jobs.executors import pgclaim

        return pgclaim.release_heads(key)
    head = Job.objects.filter(sequence_key=key, **_HELD).order_by("pk").first()
    if head is None or not passed(key, head.pk):
        return 0
    # Only while still held: a concurrent release (another look) wins once.
    released = Job.objects.filter(pk=head.pk, **_HELD).update(held_by="", updated_at=Now())
    if released:
        log.info("job=%s kind=%s arrow=sequence_head", head.pk, head.kind)
        queue.enqueue_jobs([head])
    return released


def moved(job: Job) -> None:
    """``job`` (or one of its effects) moved: its sequence's next job may start now. A
    database error is logged, not raised: the claim's own look releases it later."""
    if not job.sequence_key:
        return
    try:
        advance(job.sequence_key)
    except DatabaseError as exc:
        log.warning("job=%s sequence look failed (%s)", job.pk, type(exc).__name__)


def held_keys(after: str | None = None):
    """The keys with a held job, in key order, one index probe each (a skip scan)."""
    held = Job.objects.filter(**_HELD)
    while True:
        rows = held if after is None else held.filter(sequence_key__gt=after)
        after = rows.order_by("sequence_key").values_list("sequence_key", flat=True).first()
        if after is None:
            return
        yield after


def sweep() -> int:
    """Release every key's head whose job before it passed (the ORM's look, key by key);
    returns how many were released."""
    return sum(advance(key) for key in list(held_keys()))


@dataclass(frozen=True)
class Blocked:
    """A sequence whose head waits: the job before it (the holder) and why it waits."""

    key: str
    head: Job
    holder: Job
    waiting: int
    why: str
    releasable: bool  # a failed or dead holder an operator may release


def blocked(limit: int = 100) -> list[Blocked]:
    """The sequences whose head waits for the job before it, at most ``limit``."""
    out: list[Blocked] = []
    for key in held_keys():
        if len(out) >= limit:
            break
        held = Job.objects.filter(sequence_key=key, **_HELD)
        head = held.order_by("pk").first()
        if head is None:
            continue  # released since the key was read
        holder = Job.objects.filter(sequence_key=key, pk__lt=head.pk).order_by("-pk").first()
        if holder is None:
            continue  # its release is due at the next look
        unsettled = Effect.objects.filter(rules.to_q(rules.EFFECT_UNSETTLED), job=holder).count()
        holding = rules.holds(rules.SEQUENCE_HOLDING, holder, now=None)
        if rules.holds(rules.SEQUENCE_PASSES, holder, now=None) and not unsettled:
            continue  # it passed: released at the next look
        if holding:
            why = f"{holder.state}: holds its sequence until released"
        elif not holder.is_terminal:
            why = f"{holder.state}: not finished"
        else:
            why = f"{unsettled} effect(s) not settled"
        out.append(Blocked(key, head, holder, held.count(), why, holding))
    return out


def release(holder: Job, *, operator: str, note: str = "") -> bool:
    """Operator: a failed or dead job holding its sequence lets it go on; its next job is
    released to the claim when this commits. False when it holds nothing (any more)."""
    from jobs.engine import job_machine

    with transaction.atomic():
        if not job_machine.release_sequence(holder, actor=f"operator:{operator}", note=note):
            return False
        advance(holder.sequence_key)
    return True
