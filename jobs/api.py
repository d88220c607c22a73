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
import time
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, models, transaction
from django.db.models.functions import Now
from django.utils import timezone

from jobs import conf, failures, registry, sequences, telemetry
from jobs import debounce as debouncing
from jobs.engine import job_machine
from jobs.exceptions import JobConflict, JobError, PayloadInvalid
from jobs.models import Artifact, Effect, Job
from jobs.queue import enqueue_jobs

if TYPE_CHECKING:
    from jobs.asyncctx import AsyncJobContext
    from jobs.delivery.runner import JobContext

# A handler is a function of the context or an ``async def`` of the async context.
# A handler returns its effects (``list[EffectSpec] | None``) or its declared result (a
# dataclass or TypedDict: docs/app/kinds.md, typed results), hence ``object``.
Handler = Callable[["JobContext"], object] | Callable[["AsyncJobContext"], Awaitable[object]]
H = TypeVar("H", bound=Handler)  # the decorated handler, returned with its own type


R = TypeVar("R")  # a kind's declared result (JobHandle.result_as)


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
    if key:  # docs/app/sequences.md: held until it is its key's head and may start
        job, created = sequences.obtain(identity, defaults, key=key, skip=job_kind.sequence_skip)
    else:
        with transaction.atomic():
            job, created = Job.objects.get_or_create(**identity, defaults=defaults)
            if created:
                enqueue_jobs([job], due_now=run_after is None)
                if run_after is None:
                    job.refresh_from_db(fields=["next_attempt_at"])  # Now() as the server wrote it
    if not created and job.params != stored:
        raise JobConflict.of(job, stored)
    return job, created


def _debounced(
    job_kind: registry.JobKind, identity: dict, stored: dict, run_after, defaults: dict
) -> tuple[Job, bool]:
    """``_obtain`` for a debounced kind (``jobs.debounce``): created only by the request
    that opened a window; a closed job of this identity with other params conflicts."""
    if run_after is not None:
        raise ValueError(f"{job_kind.name} is debounced: its jobs are due when their window ends")
    job, landed = debouncing.obtain(job_kind, identity, stored, defaults)
    if landed == "existing" and job.params != stored:
        raise JobConflict.of(job, stored)
    return job, landed == "created"


@dataclass(frozen=True)
class JobFailure:
    """Why a job failed or is retrying: the retry class, a code and a readable detail, and
    for a handler's exception the exception as Python prints it and its traceback (class
    and frames only, no message, when the kind sets ``redact_errors``)."""

    error_class: str
    code: str
    detail: str
    exception: str = ""  # ``KeyError: 'pool'``
    traceback: str = ""


@dataclass(frozen=True)
class JobProgress:
    """What the handler last said of its progress (``ctx.progress``), and when (server clock)."""

    done: int
    total: int | None
    note: str
    at: datetime

    @property
    def fraction(self) -> float | None:
        """``done / total`` (at most 1), or None without a total."""
        if not self.total:
            return None
        return min(1.0, self.done / self.total)


class JobHandle:
    """A job to follow: ``id``, ``state``, ``refresh()``, ``is_finished``, ``artifact``, ..."""

    def __init__(self, job: Job, *, created: bool = False):
        self.job = job
        self.created = created

    def __repr__(self) -> str:
        return f"<JobHandle {self.job.pk} {self.job.kind} {self.job.state}>"

    @property
    def id(self) -> int:
        return self.job.pk

    @property
    def state(self) -> str:
        return self.job.state

    @property
    def is_finished(self) -> bool:
        """Succeeded, failed, dead or cancelled: nothing more will happen on its own."""
        return self.job.is_terminal

    def cancel(self, *, actor: str = "") -> str:
        """Cancel this job (``jobs.cancel``); the handle is refreshed."""
        outcome = cancel(self.id, actor=actor)
        self.refresh()
        return outcome

    def refresh(self) -> JobHandle:
        """Read the job's current state from the database."""
        self.job.refresh_from_db()
        return self

    def wait(self, timeout: float = 60.0, *, interval: float = 0.2) -> JobHandle:
        """Poll until the job is finished (for scripts and tests; never in a web request)."""
        deadline = time.monotonic() + timeout
        while not self.refresh().is_finished:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.id} still {self.state} after {timeout:g} s")
            time.sleep(interval)
        return self

    @property
    def artifact(self) -> Artifact | None:
        """The job's one artifact (stable key, sha256), once stored."""
        return self.job.artifacts.order_by("id").first()

    @property
    def effects(self) -> list[Effect]:
        """The job's ledger rows: one per effect identity, in the order they were recorded."""
        return list(self.job.effects.order_by("id"))

    @property
    def result(self) -> Any:
        """The job's ``jobs.result`` value (read now), or None if it returned none; a kind
        whose handler is annotated ``-> SomeDataclass`` gets that dataclass back."""
        value = Job.objects.values_list("result", flat=True).get(pk=self.job.pk)
        return registry.load_result(self.job.kind, value)

    def result_as(self, result_type: type[R]) -> R | None:
        """``result`` typed for a type checker: the kind's declared dataclass or TypedDict
        (``-> Totals``), or None before it has one; TypeError when it is not one."""
        value = self.result
        if value is None:
            return None
        expected = dict if typing.is_typeddict(result_type) else result_type
        if not isinstance(value, expected):
            raise TypeError(
                f"job {self.id}'s result is a {type(value).__name__}, not a {result_type.__name__}"
            )
        return typing.cast(R, value)

    @property
    def follow_ups(self) -> list[Job]:
        """The jobs its publish requested (``jobs.then``, group children, joins), in order."""
        return list(Job.objects.filter(parent=self.job).order_by("pk"))

    @property
    def progress(self) -> JobProgress | None:
        """The progress last written by the job's handler (read now), or None if it never
        reported any. The next attempt of a retried job overwrites it when it reports."""
        row = (
            Job.objects.filter(pk=self.id)
            .values("progress_done", "progress_total", "progress_note", "progress_at")
            .first()
        )
        if row is None or row["progress_at"] is None:
            return None
        for name, value in row.items():
            setattr(self.job, name, value)
        return JobProgress(
            done=row["progress_done"] or 0,
            total=row["progress_total"],
            note=row["progress_note"],
            at=row["progress_at"],
        )

    @property
    def error(self) -> JobFailure | None:
        """The last failure (class, code, detail), or None when there was none."""
        if not self.job.last_error_class and not self.job.last_error_code:
            return None
        job = self.job
        return JobFailure(
            job.last_error_class,
            job.last_error_code,
            job.last_error_detail,
            failures.headline(job.last_error_type, job.last_error_message)
            if job.last_error_type
            else "",
            job.last_error_traceback,
        )


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
    for _ in range(3):
        existing = _existing(list(first))
        for key, job in existing.items():
            if job.params != first[key].params:
                raise JobConflict.of(job, first[key].params)
        missing = [asked for key, asked in first.items() if key not in existing]
        if not missing:
            created = []
            break
        try:
            with transaction.atomic():
                created = Job.objects.bulk_create([_new_row(asked) for asked in missing])
            break
        except IntegrityError:
            continue  # another request created some of them meanwhile: read the batch again
    else:
        raise JobError("request_many: the batch kept meeting concurrent requests; ask again")
    if created:
        pairs = list(zip(created, missing, strict=True))
        enqueue_jobs([job for job, asked in pairs if asked.run_after is None])
        enqueue_jobs([job for job, asked in pairs if asked.run_after is not None], due_now=False)
        fresh = Job.objects.in_bulk([job.pk for job in created])  # Now() as the server wrote it
        existing.update({_identity(job): job for job in fresh.values()})
    new = {job.pk for job in created}
    return [
        JobHandle(job, created=job.pk in new and first[asked.key] is asked)
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


def cancel(job_id: int, *, actor: str = "") -> str:
    """Cancel a job; returns what happened, in words an operator reads.

    ``cancelled``: it had not started. ``requested``: it is running; its handler stops at
    its next ``check_owner()``/``heartbeat()`` (or reads ``ctx.cancelled``) and the job
    ends ``cancelled``. A handler that never looks still cannot publish: the request
    moved the version its publish is fenced on. ``already_finished``: it had ended
    (effects already applied are never undone); ``follow_ups_cancelled``: it had ended
    and requested follow-up jobs, and those not running were cancelled (with theirs; a
    running one finishes, docs/app/chains.md); ``missing``: no such job.
    """
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return "missing"
    if not job.is_terminal and job_machine.cancel(job, actor=actor or "api"):
        return "cancelled" if job.state == Job.State.CANCELLED else "requested"
    job.refresh_from_db()
    if job.is_terminal:
        if job_machine.cancel_follow_ups(job, actor=actor or "api"):
            return "follow_ups_cancelled"
        return "already_finished"
    return "requested"  # asked for already (by this call's race or an earlier one)
