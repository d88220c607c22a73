"""The archive pass (issue 46): long-finished jobs leave the working set, their identity stays.

A job finished longer ago than ``JOBS_ARCHIVE_AFTER_DAYS`` (never inside the redelivery
safety window, ``retention.minimum_days``), whose effects have all settled (applied,
withheld, failed or needs review: nothing pending, sending or unknown) is written as one
``ArchivedJob`` (``jobs.archived``) and its rows are deleted: the job, its attempts,
steps and events, its artifact row (the record names the file, which stays) and its
effects with their events. A later ``jobs.request`` for the identity finds the record
and says so (``JobHandle.archived``) without making a row or enqueueing anything; a
redelivery or a stale worker of the job finds no row to claim or to publish on.

An in-app notice stays in its recipient's inbox: the pass empties its ``effect`` before
the effect goes (the record keeps the effect's key and outcome, and an archived job
applies nothing again). Kept out of the pass, so that nothing still reading these rows
loses them: a group child its group has not counted, a job with a follow-up still live
or a group still to join, and a job whose artifact has a restore in flight.

Batches of ``BATCH`` jobs, one transaction each. On PostgreSQL the batch's jobs are
taken ``FOR UPDATE SKIP LOCKED`` and their effects locked before they are read, so
several hosts may archive at once, each job by one of them; SQLite serializes writers.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.core.checks import Error, Warning
from django.db import connection, router, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from jobs import conf, retention
from jobs.archived import ArchivedJob
from jobs.jobgroups import JobGroup
from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, JobEvent, JobStep, Notice

BATCH = 1000  # jobs a transaction
ROUND_BATCHES = 10  # batches one maintenance round archives at most
# How often one process's maintenance round archives: a round that finds nothing costs one
# scan, and a job gets no older than a window of days in ten minutes.
ARCHIVE_EVERY_SECONDS = 600.0
_archived_at = -math.inf  # monotonic: this process's last round (the first round archives)


@dataclass
class Archived:
    """What one archive pass did."""

    jobs: int = 0
    effects: int = 0
    batches: int = 0
    seconds: float = 0.0


def archive_after_days() -> float | None:
    """``JOBS_ARCHIVE_AFTER_DAYS`` as a float, or None when archiving is off."""
    days = conf.get("JOBS_ARCHIVE_AFTER_DAYS")
    return None if days is None else float(days)


def check_archive_days(app_configs=None, **kwargs) -> list[Error | Warning]:
    """``JOBS_ARCHIVE_AFTER_DAYS`` is outside the redelivery safety window, or unset; and
    not past ``JOBS_RETENTION_DAYS``, whose prune would drop effects before their record
    could keep them."""
    days = archive_after_days()
    if days is None:
        return []
    pruned = conf.get("JOBS_RETENTION_DAYS")
    if pruned is not None and float(pruned) < days:
        return [
            Warning(
                f"JOBS_RETENTION_DAYS ({float(pruned):g}) is shorter than JOBS_ARCHIVE_AFTER_DAYS "
                f"({days:g}): retention deletes settled effects before the archive keeps "
                "their keys",
                hint="Archive no later than retention prunes, so each effect's key is kept.",
                id="jobs.W021",
            )
        ]
    if days >= retention.minimum_days():
        return []
    return [
        Error(
            f"JOBS_ARCHIVE_AFTER_DAYS is {days:g}, inside the redelivery safety window "
            f"({retention.minimum_days():g} days)",
            hint="Set it to at least that many days, or None to archive only with jobs_prune.",
            id="jobs.E042",
        )
    ]


def archivable(cutoff) -> Q:
    """The jobs the pass may archive: finished before ``cutoff``, every effect settled, and
    nothing that still reads their rows (see the module's docstring)."""
    job = OuterRef("pk")
    unsettled = Effect.objects.filter(job=job).exclude(state__in=Effect.FINAL)
    return (
        Q(state__in=Job.TERMINAL, finished_at__lt=cutoff)
        & ~Exists(unsettled)
        & ~Q(group__isnull=False, group_outcome="")
        & ~Exists(Job.objects.filter(parent=job).exclude(state__in=Job.TERMINAL))
        & ~Exists(
            JobGroup.objects.filter(parent=job, joined_at__isnull=True, cancelled_at__isnull=True)
        )
        & ~Exists(Artifact.objects.filter(job=job, restore_requested_at__isnull=False))
    )


def archive(
    *, older_than_days: float, batch: int = BATCH, max_batches: int | None = None
) -> Archived:
    """Archive the archivable jobs finished more than ``older_than_days`` ago, a batch a
    transaction, until none is left (or ``max_batches`` ran)."""
    cutoff = _cutoff(older_than_days)
    done = Archived()
    started = time.monotonic()
    after = None
    while max_batches is None or done.batches < max_batches:
        jobs, effects, seen, after = _archive_batch(cutoff, batch, after)
        done.jobs += jobs
        done.effects += effects
        done.batches += 1
        if seen < batch:
            break
    done.seconds = time.monotonic() - started
    return done


def count_archivable(*, older_than_days: float) -> int:
    """How many jobs a pass would archive now (``jobs_prune --archive --dry-run``)."""
    return Job.objects.filter(archivable(_cutoff(older_than_days))).count()


def _cutoff(older_than_days: float):
    """Now less the window; ValueError for a window inside the redelivery safety window."""
    if older_than_days < retention.minimum_days():
        raise ValueError(
            f"archiving after {older_than_days:g} days is inside the redelivery safety "
            f"window ({retention.minimum_days():g} days)"
        )
    return timezone.now() - timedelta(days=older_than_days)


def archive_when_due() -> int:
    """The maintenance round's archive: with ``JOBS_ARCHIVE_AFTER_DAYS`` set, at most once
    every ``ARCHIVE_EVERY_SECONDS`` in this process and ``ROUND_BATCHES`` batches a
    round; returns how many jobs went."""
    global _archived_at
    days = archive_after_days()
    if days is None or time.monotonic() - _archived_at < ARCHIVE_EVERY_SECONDS:
        return 0
    _archived_at = time.monotonic()
    return archive(older_than_days=days, max_batches=ROUND_BATCHES).jobs


def _next_finished(cutoff, size: int, after: tuple | None) -> list[tuple]:
    """The next ``size`` (finished_at, id) of jobs finished before ``cutoff``, oldest
    first after ``after``: a walk of ``jobs_job_finished_idx`` that never reads a job
    twice in a pass, nor one finished after the window (the table's bulk)."""
    finished = Job.objects.filter(state__in=Job.TERMINAL, finished_at__lt=cutoff)
    if after is not None:
        at, pk = after
        finished = finished.filter(Q(finished_at__gt=at) | Q(finished_at=at, pk__gt=pk))
    return list(finished.order_by("finished_at", "pk").values_list("finished_at", "pk")[:size])


def _archive_batch(cutoff, size: int, after: tuple | None) -> tuple[int, int, int, tuple | None]:
    """One transaction: of the next ``size`` jobs finished before ``cutoff`` (after
    ``after``), take the archivable ones, write their records, delete their rows. Returns
    (jobs archived, effects archived, jobs looked at, where the walk stands)."""
    window = _next_finished(cutoff, size, after)
    if not window:
        return 0, 0, 0, after
    with transaction.atomic():
        # The rules' lookups for these ids alone, each by an index (never a whole table).
        taken = Job.objects.filter(archivable(cutoff), pk__in=[pk for _, pk in window])
        if connection.features.has_select_for_update_skip_locked:
            taken = taken.select_for_update(skip_locked=True, of=("self",))
        jobs = list(
            taken.only(
                "pk", "uid", "keys_from_id", "kind", "subject_type", "subject_id",
                "output_revision", "state", "finished_at",
            )
        )  # fmt: skip
        if not jobs:
            return 0, 0, len(window), window[-1]
        ids = [job.pk for job in jobs]
        effects = _locked_effects(ids)
        # An operator's arrow may have moved an effect between the scan and its lock.
        unsettled = {e.job_id for e in effects if e.state not in Effect.FINAL}
        keep = [job for job in jobs if job.pk not in unsettled]
        ids = [job.pk for job in keep]
        by_job: dict[int, dict[str, list[str]]] = {pk: {} for pk in ids}
        for effect in effects:
            if effect.job_id in by_job:
                by_job[effect.job_id][effect.effect_id] = [effect.idempotency_key, effect.state]
        files = _artifacts(ids)
        ArchivedJob.objects.bulk_create(
            [_record(job, files.get(job.pk), by_job[job.pk]) for job in keep]
        )
        _delete_rows(ids)
        return len(keep), sum(len(e) for e in by_job.values()), len(window), window[-1]


def _delete_rows(ids: list[int]) -> None:
    """Delete the jobs' rows, children first, each table in one statement.

    Django's cascading delete would load every row of the batch first to find what else
    points at it (two fifths of a batch's time in a profile); what points at these rows
    is known here, and the database's foreign keys still refuse a commit that would
    leave a row pointing at nothing."""
    using = router.db_for_write(Job)
    effects = Effect.objects.filter(job_id__in=ids)
    Notice.objects.filter(effect__job_id__in=ids).update(effect=None)  # the inbox keeps them
    EffectEvent.objects.filter(effect_id__in=effects.values("pk"))._raw_delete(using)
    effects._raw_delete(using)
    for model in (Artifact, Attempt, JobEvent, JobStep):
        model.objects.filter(job_id__in=ids)._raw_delete(using)
    # What Django's SET_NULL would do: a finished follow-up or a group forgets its parent.
    Job.objects.filter(parent_id__in=ids).update(parent=None)
    JobGroup.objects.filter(parent_id__in=ids).update(parent=None)
    JobGroup.objects.filter(join_id__in=ids).update(join=None)
    Job.objects.filter(pk__in=ids)._raw_delete(using)


def _locked_effects(ids: list[int]) -> list[Effect]:
    """The jobs' effects, locked on PostgreSQL (an operator's arrow waits, then finds none)."""
    effects = Effect.objects.filter(job_id__in=ids).only(
        "pk", "job_id", "effect_id", "idempotency_key", "state"
    )
    if connection.features.has_select_for_update:
        effects = effects.select_for_update(of=("self",))
    return list(effects)


def _artifacts(ids: list[int]) -> dict[int, Artifact]:
    """Each job's artifact (its first, as ``JobHandle.artifact`` reads it)."""
    found: dict[int, Artifact] = {}
    for artifact in Artifact.objects.filter(job_id__in=ids).order_by("id"):
        found.setdefault(artifact.job_id, artifact)
    return found


def _record(job: Job, artifact: Artifact | None, effects: dict) -> ArchivedJob:
    return ArchivedJob(
        uid=job.uid,
        job_id=job.pk,
        keys_from_id=job.keys_from_id,
        kind=job.kind,
        subject_type=job.subject_type,
        subject_id=job.subject_id,
        output_revision=job.output_revision,
        state=job.state,
        finished_at=job.finished_at,
        artifact_key=artifact.key if artifact else "",
        artifact_name=artifact.storage_name if artifact else "",
        artifact_sha256=artifact.sha256 if artifact else "",
        artifact_size=artifact.size if artifact else None,
        artifact_content_type=artifact.content_type if artifact else "",
        effects=effects,
    )


# --- what the rest of the engine asks of the records -----------------------------------


def stand_in(record: ArchivedJob) -> Job:
    """A read-only stand-in ``Job`` (never saved) with what ``record`` keeps; ``archived``
    tells it apart, ``archived_record`` is the record."""
    job = Job(
        pk=record.job_id,
        uid=record.uid if isinstance(record.uid, uuid.UUID) else uuid.UUID(str(record.uid)),
        keys_from_id=record.keys_from_id,
        kind=record.kind,
        subject_type=record.subject_type,
        subject_id=record.subject_id,
        output_revision=record.output_revision,
        state=record.state,
        finished_at=record.finished_at,
        updated_at=record.finished_at or record.archived_at,
    )
    job._state.adding = False
    job.archived = True  # what pages and handles tell an archived job by
    job.archived_record = record
    return job


def stand_in_artifact(record: ArchivedJob) -> Artifact | None:
    """A read-only stand-in ``Artifact`` naming the kept file, or None without one."""
    if not record.artifact_name:
        return None
    artifact = Artifact(
        job_id=record.job_id,
        key=record.artifact_key,
        storage_name=record.artifact_name,
        sha256=record.artifact_sha256,
        size=record.artifact_size or 0,
        content_type=record.artifact_content_type,
    )
    artifact.archived = True
    return artifact


def find(kind: str, subject_type: str, subject_id: str, revision: int) -> ArchivedJob | None:
    """The record of the archived job of this identity, or None."""
    return ArchivedJob.objects.filter(
        kind=kind, subject_type=subject_type, subject_id=str(subject_id), output_revision=revision
    ).first()


def find_many(keys: list[tuple[str, str, str, int]]) -> dict[tuple, ArchivedJob]:
    """The records of these identities (kind, subject_type, subject_id, revision), one query."""
    if not keys:
        return {}
    wanted = set(keys)
    rows = ArchivedJob.objects.filter(
        kind__in={k[0] for k in keys},
        subject_type__in={k[1] for k in keys},
        subject_id__in={k[2] for k in keys},
        output_revision__in={k[3] for k in keys},
    )
    found = {}
    for row in rows:
        key = (row.kind, row.subject_type, row.subject_id, row.output_revision)
        if key in wanted:
            found[key] = row
    return found


def archived_effect(effect_id: str) -> tuple[str, str] | None:
    """(idempotency key, final state) an archived job's effect was settled under, or None.

    An effect id begins with its job's key (a uid, or an id before migration 0024), so
    its record is found by that key; an effect of an archived job is never sent again
    under a new key."""
    token = effect_id.split(":", 1)[0]
    records = ArchivedJob.objects.filter(**_token_filter(token)).only("effects")
    for record in records:
        if effect_id in record.effects:
            key, state = record.effects[effect_id]
            return key, state
    return None


def _token_filter(token: str) -> dict:
    if token.isdigit():
        return {"job_id": int(token), "keys_from_id": True}
    try:
        return {"uid": uuid.UUID(token)}
    except ValueError:
        return {"pk__in": []}
