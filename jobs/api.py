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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import models, transaction
from django.db.models.functions import Now
from django.utils import timezone

from jobs import conf, failures, registry
from jobs.engine import job_machine
from jobs.exceptions import JobError, PayloadInvalid
from jobs.models import Artifact, Effect, Job
from jobs.queue import enqueue_job

if TYPE_CHECKING:
    from jobs.delivery.runner import JobContext

Handler = Callable[["JobContext"], "list[registry.EffectSpec] | None"]


class JobConflict(JobError, ValueError):
    """Raised when a job with this identity exists and was asked for with other params."""

    error_class = "validation"
    code = "identity_conflict"


def kind(
    name: str,
    *,
    max_attempts: int | None = None,
    authorize_release: Callable[[Effect], str | None] | None = None,
    redact_errors: bool | Callable[[BaseException], bool] = False,
    priority: int = 0,
    queue: str = "default",
    timeout: float | None = None,
) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of job kind ``name``.

    Put kinds in a module ``jobkinds.py`` of any installed app: the app loads
    those modules at start-up, so every process (web, qcluster) knows every kind.
    ``redact_errors=True`` (or a predicate on the exception): the handler's
    exception messages may quote private values, so only class and frames are kept.
    ``priority`` (-100..100, higher first) and ``queue`` are its jobs' defaults;
    ``timeout`` is how many seconds one attempt may run.
    """

    def register(handler: Handler) -> Handler:
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
) -> tuple[Job, bool]:
    """The one job for (kind, subject, revision) and whether this call created it.

    Created and enqueued in one transaction (the ORM broker commits the message
    with the row); due times are the database server's clock. With ``run_after``
    no message is sent now: the dispatcher sends it when the job is due by that
    clock, as it does for retries.
    """
    job_kind = registry.get_kind(kind)
    stored = _as_stored(params)
    priority = job_kind.priority if priority is None else registry.check_priority(priority)
    queue = job_kind.queue if queue is None else registry.check_queue(queue)
    if run_after is not None and timezone.is_naive(run_after):
        raise ValueError("run_after must be an aware datetime")
    now = timezone.now()  # shown to people; due times are the server's clock
    with transaction.atomic():
        job, created = Job.objects.get_or_create(
            kind=kind,
            subject_type=subject_type,
            subject_id=str(subject_id),
            output_revision=output_revision,
            defaults={
                "tenant_key": tenant_key,
                "params": stored,
                "max_attempts": max_attempts or job_kind.max_attempts or conf.max_attempts(),
                "priority": priority,
                "queue": queue,
                "next_attempt_at": Now() if run_after is None else run_after,
                "enqueued_for": Now() if run_after is None else None,
                "created_at": now,
                "updated_at": now,
            },
        )
        if created and run_after is None:
            enqueue_job(job)
            job.refresh_from_db(fields=["next_attempt_at", "enqueued_for"])
    if not created and job.params != stored:
        gone = object()
        keys = sorted(
            k for k in {*job.params, *stored} if job.params.get(k, gone) != stored.get(k, gone)
        )
        raise JobConflict(
            f"job {job.pk} ({kind} {subject_type}:{subject_id} revision {output_revision}) "
            f"exists with other params (keys differing: {', '.join(keys) or '-'}); "
            "ask for a new revision to get a new output"
        )
    return job, created


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
) -> JobHandle:
    """Ask for the one job of ``kind`` for ``subject`` at ``revision``; returns its handle.

    ``params`` hold references (ids, flags), never private data: the handler
    reads that when it runs. ``run_after`` delays the first attempt. ``tenant``
    groups jobs under ``JOBS_TENANT_CONCURRENCY``. ``max_attempts`` overrides the
    kind's budget (the ``django.tasks`` backend's ``MAX_ATTEMPTS``). ``priority``
    (-100..100, higher first) and ``queue`` override the kind's. The one way to ask
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
    )
    return JobHandle(job, created=created)


def cancel(job_id: int, *, actor: str = "") -> str:
    """Cancel a job; returns what happened, in words an operator reads.

    ``cancelled``: it had not started. ``requested``: it is running; its handler stops at
    its next ``check_owner()``/``heartbeat()`` (or reads ``ctx.cancelled``) and the job
    ends ``cancelled``. A handler that never looks still cannot publish: the request
    moved the version its publish is fenced on. ``already_finished``: it had ended
    (effects already applied are never undone); ``missing``: no such job.
    """
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return "missing"
    if not job.is_terminal and job_machine.cancel(job, actor=actor or "api"):
        return "cancelled" if job.state == Job.State.CANCELLED else "requested"
    job.refresh_from_db()
    if job.is_terminal:
        return "already_finished"
    return "requested"  # asked for already (by this call's race or an earlier one)
