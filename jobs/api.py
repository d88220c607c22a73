"""The public API: declare a kind, ask for a job, follow it through a handle.

Re-exported from ``jobs`` (``jobs.kind``, ``jobs.request``, ...). A job's identity
is (kind, subject, revision): asking twice returns the same job, and asking
again with other ``params`` is an error instead of a silent drop, since the
existing job will not run with them. A new output needs a new revision.

    @jobs.kind("billing.invoice", max_attempts=5)
    def invoice(ctx): ...

    handle = jobs.request("billing.invoice", order, revision=3, params={"user_id": 7})
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, models, transaction
from django.db.models.functions import Now
from django.utils import timezone

from jobs import archive, conf, registry, sequences, telemetry
from jobs import debounce as debouncing
from jobs.exceptions import JobConflict, JobError, PayloadInvalid
from jobs.handles import JobFailure, JobHandle, JobProgress, cancel  # noqa: F401 (re-exported)
from jobs.models import Effect, Job
from jobs.queue import enqueue_jobs

if TYPE_CHECKING:
    from jobs.asyncctx import AsyncJobContext
    from jobs.delivery.runner import JobContext

# A handler is a function of the context or an ``async def`` of the async context.
# A handler returns its effects (``list[EffectSpec] | None``) or its declared result (a
# dataclass or TypedDict: docs/app/kinds.md, typed results), hence ``object``.
Handler = Callable[["JobContext"], object] | Callable[["AsyncJobContext"], Awaitable[object]]
H = TypeVar("H", bound=Handler)  # the decorated handler, returned with its own type


def kind(
    name: str,
    *,
    max_attempts: int | None = None,
    authorize_release: Callable[[Effect], str | None] | None = None,
    redact_errors: bool | Callable[[BaseException], bool] = False,
    priority: int = 0,
    queue: str = "default",
    timeout: float | None = None,
    schedule: str | timedelta | None = None,
    schedule_tz: str | None = None,
    catch_up: str = "latest",
    on_child_failure: str = "fail",
    labels: dict[str, str] | None = None,
    debounce: float | None = None,
    debounce_max: float | None = None,
    debounce_key: Callable[[dict, tuple[str, str]], str] | None = None,
    sequence: Callable[[dict, tuple[str, str]], str] | None = None,
    on_failure: str = "hold",
) -> Callable[[H], H]:
    """Register the decorated function as the handler of job kind ``name``.

    Put kinds in a module ``jobkinds.py`` of any installed app: the app loads
    those modules at start-up, so every process (web, qcluster) knows every kind.
    ``redact_errors=True`` (or a predicate on the exception): the handler's
    exception messages may quote private values, so only class and frames are kept.
    ``priority`` (-100..100, higher first) and ``queue`` are its jobs' defaults;
    ``timeout`` is how many seconds one attempt may run. ``schedule`` (a cron
    expression read in ``schedule_tz``, or a ``timedelta``) makes it periodic: one job
    per tick, ``catch_up`` ``"latest"`` or ``"all"`` after downtime (docs/app/schedules.md).
    ``on_child_failure`` (``"fail"``, ``"skip"`` or ``"run"``): what a group's child that
    did not succeed does to this kind's join (docs/app/chains.md). ``labels`` names its
    job, result, effect and job states in the project's words for the console
    (docs/app/console.md). ``debounce`` (seconds): requests under one key (the subject, or
    ``debounce_key(params, subject)``) until the job's first claim make one job, with the
    last one's params, due at most ``debounce_max`` after the first (docs/app/debounce.md).
    ``sequence(params, subject)``: its jobs of one key start one at a time in request order,
    each once the one before ended and its effects settled; a failed one holds the key
    (``on_failure="hold"``) or lets it go on (``"skip"``) (docs/app/sequences.md).
    """

    def register(handler: H) -> H:
        known = registry.kinds().get(name)
        if known is not None and _path(known.handler) != _path(handler):
            raise ImproperlyConfigured(
                f"job kind {name!r} is declared twice: by {_path(known.handler)} "
                f"and by {_path(handler)}"
            )
        registry.register_kind(
            name,
            handler,
            authorize_release=authorize_release,
            max_attempts=max_attempts,
            redact_errors=redact_errors,
            priority=priority,
            queue=queue,
            timeout=timeout,
            schedule=schedule,
            schedule_tz=schedule_tz,
            catch_up=catch_up,
            on_child_failure=on_child_failure,
            labels=labels,
            debounce=debounce,
            debounce_max=debounce_max,
            debounce_key=debounce_key,
            sequence=sequence,
            on_failure=on_failure,
        )
        return handler

    return register


def _path(func: Callable) -> str:
    return f"{func.__module__}.{getattr(func, '__qualname__', repr(func))}"


def subject_reference(subject: models.Model | tuple[str, str | int]) -> tuple[str, str]:
    """(subject_type, subject_id) of a saved model instance or a ``(type, id)`` pair."""
    if isinstance(subject, models.Model):
        if subject.pk is None:
            raise ValueError("the subject must be saved first: it has no primary key")
        return subject._meta.label_lower, str(subject.pk)
    if isinstance(subject, (tuple, list)) and len(subject) == 2:
        subject_type, subject_id = subject
        if not str(subject_type) or str(subject_id) == "":
            raise ValueError("a (type, id) subject needs a non-empty type and id")
        return str(subject_type), str(subject_id)
    raise TypeError(
        f"subject must be a model instance or a (type, id) pair, not {type(subject).__name__}"
    )


def _as_stored(params: dict | None) -> dict:
    """``params`` as the JSON column will hold them (and PayloadInvalid if they cannot be)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise PayloadInvalid("params must be a dict of JSON values (ids and flags)")
    try:
        return json.loads(json.dumps(params, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise PayloadInvalid(f"params must be JSON-serialisable: {type(exc).__name__}") from None


def _obtain(
    kind: str,
    *,
    subject_type: str,
    subject_id: str | int,
    output_revision: int = 1,
    tenant_key: str = "",
    params: dict | None = None,
    run_after: datetime | None = None,
    max_attempts: int | None = None,
    priority: int | None = None,
    queue: str | None = None,
    sequence_key: str | None = None,
) -> tuple[Job, bool]:
    """The one job for (kind, subject, revision) and whether this call created it.

    Created and enqueued in one transaction (the broker's message commits with the
    row); due times are the database server's clock. With ``run_after`` the
    PostgreSQL broker gets the message now and hands it out at that time; on
    django-q2's ORM broker the dispatcher sends it when the job is due by that
    clock, as it does for retries.
    """
    job_kind = registry.get_kind(kind)
    stored = _as_stored(params)
    priority = job_kind.priority if priority is None else registry.check_priority(priority)
    queue = job_kind.queue if queue is None else registry.check_queue(queue)
    if run_after is not None and timezone.is_naive(run_after):
        raise ValueError("run_after must be an aware datetime")
    now = timezone.now()  # shown to people; due times are the server's clock
    identity = {
        "kind": kind,
        "subject_type": subject_type,
        "subject_id": str(subject_id),
        "output_revision": output_revision,
    }
    defaults = {
        "tenant_key": tenant_key,
        "max_attempts": max_attempts or job_kind.max_attempts or conf.max_attempts(),
        "priority": priority,
        "queue": queue,
        "created_at": now,
        "updated_at": now,
        "trace_context": telemetry.request_traceparent(),
    }
    key = sequences.key_of(
        job_kind.sequence, sequence_key, stored, (subject_type, identity["subject_id"])
    )
    if job_kind.debounce is not None:
        if key:
            raise ValueError(f"{kind} is debounced: its jobs are in no sequence")
        return _debounced(job_kind, identity, stored, run_after, defaults)
    defaults.update(params=stored, next_attempt_at=Now() if run_after is None else run_after)
    try:
        with transaction.atomic():
            if key:  # docs/app/sequences.md: held until it is its key's head and may start
                job, created = sequences.obtain(
                    identity, defaults, key=key, skip=job_kind.sequence_skip
                )
            else:
                job, created = Job.objects.get_or_create(**identity, defaults=defaults)
            if created:
                _refuse_if_archived(identity)
            if created and not key:
                enqueue_jobs([job], due_now=run_after is None)
                if run_after is None:
                    # Now() as the server wrote it
                    job.refresh_from_db(fields=["next_attempt_at"])
    except _WasArchived as found:
        # The row made above was rolled back: an archived job is never made again.
        return archive.stand_in(found.record), False
    if not created and job.params != stored:
        raise JobConflict.of(job, stored)
    return job, created


class _WasArchived(Exception):
    """Raised inside a request's transaction to roll back a row whose identity was archived."""

    def __init__(self, record):
        super().__init__(record.job_id)
        self.record = record


def _archived(identity: dict):
    """The archive's record of ``identity`` (``Job``'s unique fields), or None."""
    kind, subject_type = identity["kind"], identity["subject_type"]
    return archive.find(kind, subject_type, identity["subject_id"], identity["output_revision"])


def _refuse_if_archived(identity: dict) -> None:
    """Raise ``_WasArchived`` when the identity a new row was just made for was archived.

    Read after the INSERT, in its transaction: on PostgreSQL an archive pass deleting the
    old row makes the INSERT wait on the unique index until it commits, so this read sees
    its record; SQLite serializes writers. One query, on creation only (issue 46)."""
    record = _archived(identity)
    if record is not None:
        raise _WasArchived(record)


def _debounced(
    job_kind: registry.JobKind, identity: dict, stored: dict, run_after, defaults: dict
) -> tuple[Job, bool]:
    """``_obtain`` for a debounced kind (``jobs.debounce``): created only by the request
    that opened a window; a closed job of this identity with other params conflicts."""
    if run_after is not None:
        raise ValueError(f"{job_kind.name} is debounced: its jobs are due when their window ends")
    record = _archived(identity)
    if record is not None:
        return archive.stand_in(record), False
    job, landed = debouncing.obtain(job_kind, identity, stored, defaults)
    if landed == "existing" and job.params != stored:
        raise JobConflict.of(job, stored)
    return job, landed == "created"


@telemetry.traced_request
def request(
    kind: str,
    subject: models.Model | tuple[str, str | int],
    *,
    revision: int = 1,
    params: dict[str, Any] | None = None,
    run_after: datetime | None = None,
    tenant: str = "",
    max_attempts: int | None = None,
    priority: int | None = None,
    queue: str | None = None,
    sequence_key: str | None = None,
) -> JobHandle:
    """Ask for the one job of ``kind`` for ``subject`` at ``revision``; returns its handle.

    ``params`` hold references (ids, flags), never private data: the handler
    reads that when it runs. ``run_after`` delays the first attempt. ``tenant``
    groups jobs under ``JOBS_TENANT_CONCURRENCY``. ``max_attempts`` overrides the
    kind's budget (the ``django.tasks`` backend's ``MAX_ATTEMPTS``). ``priority``
    (-100..100, higher first) and ``queue`` override the kind's; ``sequence_key`` puts
    the job at the end of that key's sequence (docs/app/sequences.md). The one way to ask
    for a job: the site, the ``django.tasks`` backend and the drills all come here.
    """
    subject_type, subject_id = subject_reference(subject)
    job, created = _obtain(
        kind,
        subject_type=subject_type,
        subject_id=subject_id,
        output_revision=revision,
        tenant_key=tenant,
        params=params,
        run_after=run_after,
        max_attempts=max_attempts,
        priority=priority,
        queue=queue,
        sequence_key=sequence_key,
    )
    return JobHandle(job, created=created)


@dataclass(frozen=True)
class JobRequest:
    """One job ``jobs.request_many`` asks for: the arguments of ``jobs.request``."""

    kind: str
    subject: models.Model | tuple[str, str | int]
    revision: int = 1
    params: dict[str, Any] | None = None
    run_after: datetime | None = None
    tenant: str = ""
    max_attempts: int | None = None
    priority: int | None = None
    queue: str | None = None


# Jobs written per INSERT batch of ``request_many`` (each batch: a fixed handful of statements).
BULK_BATCH = 500
_IDENTITY = ("kind", "subject_type", "subject_id", "output_revision")


def request_many(
    items: Iterable[JobRequest | Mapping[str, Any]], *, batch_size: int = BULK_BATCH
) -> list[JobHandle]:
    """Ask for many jobs at once: ``jobs.request`` for each item (a ``JobRequest`` or a
    dict of its fields), in one transaction and a fixed number of statements per batch.

    The same identity rules: an existing (kind, subject, revision) returns its handle
    (``created`` False), and asking for it with other params raises ``JobConflict``, as
    does one call naming an identity twice with different params; either way nothing
    of the call is written. Handles come back in the order of ``items``. Per batch: one
    SELECT of the existing jobs, one INSERT of the new ones (Django splits it where the
    database caps a statement's parameters: SQLite), one read back, one message INSERT.
    """
    asked = [_prepared(i if isinstance(i, JobRequest) else JobRequest(**i)) for i in items]
    handles: list[JobHandle] = []
    with transaction.atomic():
        for start in range(0, len(asked), max(1, batch_size)):
            handles.extend(_obtain_batch(asked[start : start + batch_size]))
    return handles


@dataclass(frozen=True)
class _Asked:
    key: tuple[str, str, str, int]
    fields: dict[str, Any]  # the new row's, when it is created
    params: dict
    run_after: datetime | None


def _prepared(r: JobRequest) -> _Asked:
    """The checks ``_obtain`` makes, before anything is written."""
    job_kind = registry.get_kind(r.kind)
    if job_kind.debounce is not None or job_kind.sequence is not None:
        raise ValueError(f"{r.kind} is debounced or sequenced: ask with jobs.request, one a call")
    subject_type, subject_id = subject_reference(r.subject)
    if r.run_after is not None and timezone.is_naive(r.run_after):
        raise ValueError("run_after must be an aware datetime")
    stored = _as_stored(r.params)
    key = (r.kind, subject_type, str(subject_id), int(r.revision))
    fields = {
        "tenant_key": r.tenant,
        "params": stored,
        "max_attempts": r.max_attempts or job_kind.max_attempts or conf.max_attempts(),
        "priority": job_kind.priority
        if r.priority is None
        else registry.check_priority(r.priority),
        "queue": job_kind.queue if r.queue is None else registry.check_queue(r.queue),
    }
    return _Asked(key, fields, stored, r.run_after)


def _obtain_batch(batch: list[_Asked]) -> list[JobHandle]:
    """The jobs of one batch, created where missing, with their messages.

    The INSERT runs in a savepoint: a request that created one of these identities
    since the SELECT makes it fail whole (the unique constraint), and the batch is read
    again, so ``created`` is true exactly for the rows this call inserted.
    """
    first: dict[tuple, _Asked] = {}
    for asked in batch:
        seen = first.setdefault(asked.key, asked)
        if seen.params != asked.params:
            kind, subject_type, subject_id, revision = asked.key
            raise JobConflict(
                f"{kind} {subject_type}:{subject_id} revision {revision} is asked for twice "
                "with different params in one request_many"
            )
    archived: dict[tuple, Job] = {}  # identities archived (issue 46): their stand-ins
    for _ in range(3):
        existing = _existing(list(first))
        for key, job in existing.items():
            if job.params != first[key].params:
                raise JobConflict.of(job, first[key].params)
        missing = [a for key, a in first.items() if key not in existing and key not in archived]
        if not missing:
            created = []
            break
        try:
            with transaction.atomic():
                created = Job.objects.bulk_create([_new_row(asked) for asked in missing])
                found = archive.find_many([asked.key for asked in missing])  # as _obtain's
                if found:
                    archived.update(
                        {key: archive.stand_in(record) for key, record in found.items()}
                    )
                    raise IntegrityError("archived identities: the batch is asked for again")
            break
        except IntegrityError:
            continue  # another request created some of them meanwhile: read the batch again
    else:
        raise JobError("request_many: the batch kept meeting concurrent requests; ask again")
    existing.update(archived)
    if created:
        pairs = list(zip(created, missing, strict=True))
        enqueue_jobs([job for job, asked in pairs if asked.run_after is None])
        enqueue_jobs([job for job, asked in pairs if asked.run_after is not None], due_now=False)
        fresh = Job.objects.in_bulk([job.pk for job in created])  # Now() as the server wrote it
        existing.update({_identity(job): job for job in fresh.values()})
    new = {job.pk for job in created}
    return [
        JobHandle(
            job,
            created=job.pk in new and first[asked.key] is asked and not hasattr(job, "archived"),
        )
        for asked in batch
        for job in [existing[asked.key]]
    ]


def _identity(job: Job) -> tuple[str, str, str, int]:
    return (job.kind, job.subject_type, job.subject_id, job.output_revision)


def _existing(keys: list[tuple]) -> dict[tuple, Job]:
    """The jobs of these identities, in one SELECT (IN lists per column, then exact keys)."""
    if not keys:
        return {}
    columns = {name: {key[i] for key in keys} for i, name in enumerate(_IDENTITY)}
    wanted = set(keys)
    rows = Job.objects.filter(**{f"{name}__in": values for name, values in columns.items()})
    return {_identity(job): job for job in rows if _identity(job) in wanted}


def _new_row(asked: _Asked) -> Job:
    kind, subject_type, subject_id, revision = asked.key
    now = timezone.now()  # shown to people; due times are the server's clock
    return Job(
        kind=kind,
        subject_type=subject_type,
        subject_id=subject_id,
        output_revision=revision,
        next_attempt_at=Now() if asked.run_after is None else asked.run_after,
        created_at=now,
        updated_at=now,
        **asked.fields,
    )
