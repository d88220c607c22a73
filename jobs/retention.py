"""Retention: old delivery history and finished ledger rows, never inside the redelivery window.

Pruning an effect's identity forgets that the outcome happened; if anything
could still ask for it again, the ledger could no longer say "already done".
So only effects in a final state, of finished jobs, older than a window far
longer than any redelivery (django-q2 ``retry``, leases, the dispatcher's
re-drives) are removed. Job rows are kept here: they are what makes a second
request for the same output return the same job, until the archive pass
(``jobs.archive``, ``JOBS_ARCHIVE_AFTER_DAYS``) replaces them by identity records.

Artifact files named by no row (orphans: a late writer's bytes, a crashed
worker's file of a job that later published other bytes, a torn temporary file)
are deleted once older than ``JOBS_ORPHAN_GRACE_SECONDS`` and only when their job
is not live (queued, running, waiting for a retry), whose next delivery could still
publish (reuse) the file. A file a row names is never deleted. Listing, reading
times and deleting go through Django's Storage API only, so an object store works
as well as the filesystem.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

from django.core.checks import Error
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from jobs import archived, artifacts, conf, identity, manifests
from jobs.models import ArchivedJob, Artifact, Attempt, Effect, Job


def minimum_days() -> float:
    """The shortest window allowed: a week, or 100x the longest redelivery delay."""
    q = conf.q_cluster()
    longest = max(
        float(q.get("retry", 60)),
        conf.lease_seconds(),
        float(conf.get("JOBS_EFFECT_LEASE_SECONDS")),
        float(conf.get("JOBS_BACKOFF_CAP_SECONDS")),
    )
    return max(float(conf.get("JOBS_PRUNE_MIN_DAYS")), 100 * longest / 86400)


# How often one process's maintenance round prunes (JOBS_RETENTION_DAYS): a prune that
# finds nothing costs two index scans, and nothing gets old faster than an hour matters.
PRUNE_EVERY_SECONDS = 3600.0
_pruned_at = -math.inf  # monotonic: this process's last prune (the first round prunes)


def prune_when_due() -> int:
    """The maintenance round's retention: with ``JOBS_RETENTION_DAYS`` set, prune at most
    once an hour in this process; returns how many rows went. Several hosts pruning at
    once delete disjoint or no rows (each a plain DELETE of rows past the window)."""
    global _pruned_at
    days = conf.get("JOBS_RETENTION_DAYS")
    if days is None or time.monotonic() - _pruned_at < PRUNE_EVERY_SECONDS:
        return 0
    _pruned_at = time.monotonic()
    counts = prune(older_than_days=float(days))
    return counts["attempts"] + counts["effects"]


def check_retention_days(app_configs=None, **kwargs):
    """``JOBS_RETENTION_DAYS`` is outside the redelivery safety window, or unset."""
    days = conf.get("JOBS_RETENTION_DAYS")
    if days is None or float(days) >= minimum_days():
        return []
    return [
        Error(
            f"JOBS_RETENTION_DAYS is {days}, inside the redelivery safety window "
            f"({minimum_days():g} days)",
            hint="Set it to at least that many days, or None to prune only with jobs_prune.",
            id="jobs.E041",
        )
    ]


def prune(*, older_than_days: float, dry_run: bool = False) -> dict[str, int]:
    """Delete attempts and final effects of terminal jobs finished before the window."""
    if older_than_days < minimum_days():
        raise ValueError(
            f"--older-than {older_than_days:g} is inside the redelivery safety window "
            f"({minimum_days():g} days)"
        )
    cutoff = timezone.now() - timedelta(days=older_than_days)
    finished = Job.objects.filter(state__in=Job.TERMINAL, finished_at__lt=cutoff)
    attempts = Attempt.objects.filter(job__in=finished, started_at__lt=cutoff)
    effects = Effect.objects.filter(
        job__in=finished,
        state__in=[Effect.State.APPLIED, Effect.State.WITHHELD, Effect.State.FAILED],
        updated_at__lt=cutoff,
        notice__isnull=True,
    )
    counts = {"attempts": attempts.count(), "effects": effects.count()}
    if not dry_run:
        with transaction.atomic():
            attempts.delete()
            effects.delete()
    return counts


def _walk(storage, folder: str) -> Iterator[str]:
    """Every file name under ``folder`` of ``storage`` (Storage.listdir, recursively)."""
    try:
        dirs, files = storage.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in files:
        yield f"{folder}/{name}"
    for sub in dirs:
        yield from _walk(storage, f"{folder}/{sub}")


def stored_names() -> Iterator[str]:
    """Every file name under the artifact storage's folder."""
    return _walk(artifacts.get_storage(), artifacts.FOLDER)


def orphans(*, older_than_seconds: float | None = None) -> list[str]:
    """Artifact files no row names, of no live job (older than the given age, if any)."""
    storage = artifacts.get_storage()
    named = set(Artifact.objects.values_list("storage_name", flat=True))
    candidates = [
        name
        for name in _walk(storage, artifacts.FOLDER)
        if name not in named and not manifests.is_manifest(name)  # identities: not orphans
    ]
    kept = archived.kept_names(candidates)  # an archived job's file: its record names it
    candidates = [name for name in candidates if name not in kept]
    live = _live_keys(candidates)
    cutoff = None
    if older_than_seconds is not None:
        cutoff = timezone.now() - timedelta(seconds=older_than_seconds)
    found = []
    for name in candidates:
        if _key_token(name) in live:
            continue  # its next delivery may still publish this very file
        if cutoff is not None:
            try:
                if storage.get_modified_time(name) >= cutoff:
                    continue
            except (FileNotFoundError, OSError):
                continue
        found.append(name)
    return found


def _key_token(name: str) -> str | None:
    """The job part of a file's key (a uid, or an id before migration 0024), or None."""
    found = identity.KEY_IN_NAME.search(name)
    return None if found is None else found.group("job")


def _live_keys(names: list[str]) -> set[str]:
    """The key tokens (``_key_token``) of the names whose job is not finished.

    A name finds its own job only (``identity.job_lookup``): an orphan of a job a
    failover lost is not kept alive by a new job that got the same id.
    """
    tokens = {t for t in map(_key_token, names) if t is not None}
    ids = {int(t) for t in tokens if t.isdigit()}
    uids = {uuid.UUID(t) for t in tokens if not t.isdigit()}
    if not tokens:
        return set()
    live = Job.objects.exclude(state__in=Job.TERMINAL).filter(
        Q(pk__in=ids, keys_from_id=True) | Q(uid__in=uids)
    )
    return {identity.job_key(job) for job in live.only("pk", "uid", "keys_from_id")}


def prune_orphans(*, dry_run: bool = False) -> int:
    """Delete orphan artifact files older than ``JOBS_ORPHAN_GRACE_SECONDS``; their count.

    The listing is only a list of candidates: each file is looked at again as it is
    deleted (``_delete_if_orphan``), so a file that a requeued job's publish named
    since the listing stays.
    """
    stale = orphans(older_than_seconds=conf.orphan_grace_seconds())
    if dry_run:
        return len(stale)
    storage = artifacts.get_storage()
    return sum(_delete_if_orphan(storage, name) for name in stale)


def _delete_if_orphan(storage, name: str) -> bool:
    """Delete ``name`` if still no row names it and its job is still finished; whether it did.

    The job's row is locked while the file is checked and deleted: an operator's requeue
    (a CAS on that row) waits until the file is gone, and a delivery can publish only
    after a requeue, so no publish can name the file between the check and the delete.
    A job requeued before the lock is live, and its file is kept.
    """
    found = identity.job_lookup(name)
    with transaction.atomic():
        if found is not None:
            state = (
                Job.objects.select_for_update()
                .filter(**found)
                .values_list("state", flat=True)
                .first()
            )
            if state is not None and state not in Job.TERMINAL:
                return False  # live again: its next delivery may publish this very file
        if Artifact.objects.filter(storage_name=name).exists():
            return False  # a row written since the listing keeps its file
        if ArchivedJob.objects.filter(artifact_name=name).exists():
            return False  # archived since the listing: its record names the file
        storage.delete(name)
    return True


def prune_manifests(*, dry_run: bool = False) -> int:
    """Delete the identity manifests (``jobs.manifests``) of finished jobs older than
    ``JOBS_ORPHAN_GRACE_SECONDS``; their count.

    A manifest is what ``jobs_reconcile`` asks a lost job for again with, so one whose
    job has no row (a failover lost it) or is live is kept; one of a finished job is
    evidence no longer needed once the grace is over, like an orphan.
    """
    storage = artifacts.get_storage()
    cutoff = timezone.now() - timedelta(seconds=conf.orphan_grace_seconds())
    names = list(_walk(storage, manifests.FOLDER))
    tokens = {t for t in map(_key_token, names) if t is not None}
    ids = {int(t) for t in tokens if t.isdigit()}
    uids = {uuid.UUID(t) for t in tokens if not t.isdigit()}
    finished = Job.objects.filter(state__in=Job.TERMINAL).filter(
        Q(pk__in=ids, keys_from_id=True) | Q(uid__in=uids)
    )
    done = {identity.job_key(job) for job in finished.only("pk", "uid", "keys_from_id")}
    done |= archived.known_tokens(tokens)  # archived: finished, and not lost
    count = 0
    for name in names:
        if _key_token(name) not in done:
            continue
        try:
            if storage.get_modified_time(name) >= cutoff:
                continue
        except (FileNotFoundError, OSError):
            continue
        if not dry_run:
            storage.delete(name)
        count += 1
    return count
