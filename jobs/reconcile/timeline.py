"""Reconcile once after the database moved to a new timeline (a promotion, issue 47).

PostgreSQL starts a new timeline whenever a standby is promoted (the current WAL file's
name starts with it; ``pg_control_checkpoint()`` shows it only after the next
checkpoint). The maintenance loop (``jobs.dispatch.dispatch_once``) calls ``watch``: at
most every ``CHECK_EVERY`` seconds per process it reads the server's timeline and
compares it with the durable mark (``ReconcileMark``, a row in the same database, so the
promoted server has the old primary's mark). The host whose compare-and-swap claims the
change runs ``reconcile`` and moves the mark; a claim whose holder died runs out after
``CLAIM_SECONDS`` and another host takes it.

Not on PostgreSQL there is no timeline: nothing happens (run ``jobs_reconcile`` by hand
after a failover). Never raises: maintenance goes on whatever happens here.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from django.db import DatabaseError, connection, transaction
from django.db.models import Q
from django.db.models.functions import Now

log = logging.getLogger("jobs.reconcile")

MARK = "timeline"
CHECK_EVERY = 10.0  # seconds between looks at the server's timeline, per process
CLAIM_SECONDS = 600.0  # a reconcile's claim runs out after this (its host died)

_next_check = 0.0


def server_timeline() -> int | None:
    """The server's current timeline, or None (not PostgreSQL, no right to read it)."""
    if connection.vendor != "postgresql":
        return None
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(_TIMELINE)
            row = cursor.fetchone()
    except DatabaseError:
        return None
    return int(row[0], 16) if row and row[0] else None


# The timeline of the WAL being written now: the first 8 hex digits of its file's name.
# ``pg_control_checkpoint()``'s timeline_id lags: a promoted server moves it only with its
# first checkpoint after the promotion, which may be minutes later. Any role may ask
# this; on a standby (no current WAL) it fails, and there is nothing to reconcile there.
_TIMELINE = "SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)"


def watch(*, worker: str = "") -> str:
    """Reconcile if the timeline changed since the mark; what happened (for the log)."""
    global _next_check
    now = time.monotonic()
    if now < _next_check:
        return ""
    _next_check = now + CHECK_EVERY
    try:
        return _watch(worker or _worker())
    except Exception as exc:  # maintenance goes on; the next look tries again
        log.warning("reconcile after a timeline change failed: %s", type(exc).__name__)
        return f"failed {type(exc).__name__}"


def _watch(worker: str) -> str:
    from jobs.models import ReconcileMark

    current = server_timeline()
    if current is None:
        return ""
    mark, made = ReconcileMark.objects.get_or_create(name=MARK, defaults={"timeline": current})
    if made or mark.timeline == current:
        return ""  # the first look: nothing to compare with yet
    claimable = Q(claimed_until__isnull=True) | Q(claimed_until__lt=Now())
    won = ReconcileMark.objects.filter(claimable, name=MARK, timeline=mark.timeline).update(
        claimed_by=worker[:200], claimed_until=Now() + timedelta(seconds=CLAIM_SECONDS)
    )
    if not won:
        return ""  # another host reconciles
    from jobs.reconcile import reconcile

    report = reconcile()
    ReconcileMark.objects.filter(name=MARK, claimed_by=worker[:200]).update(
        timeline=current, claimed_by="", claimed_until=None, updated_at=Now()
    )
    line = (
        f"timeline {mark.timeline}->{current} lost={len(report.lost)} "
        f"asked_again={report.asked_again} unknown_keys={len(report.unknown)} "
        f"marked={report.marked}"
    )
    log.warning("reconciled after a failover: %s", line)
    return line


def _worker() -> str:
    from jobs.engine.job_machine import worker_identity

    return worker_identity()
