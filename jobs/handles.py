"""A job's handle (``jobs.request`` returns one), what it reads (failures, progress), and
``jobs.cancel``.

Re-exported from ``jobs`` and ``jobs.api``. A handle of an archived job (issue 46,
``jobs.archive``) says so (``archived``): its id, final state, finished time and
artifact come from the identity record; nothing else of the job is kept.
"""

from __future__ import annotations

import time
import typing
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from jobs import failures, registry
from jobs.engine import job_machine
from jobs.models import Artifact, Effect, Job

R = TypeVar("R")  # a kind's declared result (JobHandle.result_as)


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

    @property
    def archived(self) -> bool:
        """The job was archived (``jobs.archive``): its rows are gone, its identity record
        answers for it (id, final state, finished time, artifact; never run again)."""
        return getattr(self.job, "archived", False)

    @property
    def finished_at(self) -> datetime | None:
        """When the job reached its final state (None while it has not)."""
        return self.job.finished_at

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
        """Read the job's current state from the database (an archived job's is final)."""
        if self.archived:
            return self
        try:
            self.job.refresh_from_db()
        except Job.DoesNotExist:
            from jobs import archive

            record = archive.find(
                self.job.kind, self.job.subject_type, self.job.subject_id, self.job.output_revision
            )
            if record is None or record.uid != self.job.uid:
                raise  # not archived: deleted another way
            self.job = archive.stand_in(record)  # archived since this handle was made
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
        """The job's one artifact (stable key, sha256), once stored; an archived job's
        from its record (a stand-in naming the kept file)."""
        if self.archived:
            from jobs import archive

            return archive.stand_in_artifact(self._record())
        return self.job.artifacts.order_by("id").first()

    @property
    def effects(self) -> list[Effect]:
        """The job's ledger rows: one per effect identity, in the order they were recorded
        (an archived job's: stand-ins with the effect id, its key and final state)."""
        if self.archived:
            return [
                Effect(job_id=self.id, effect_id=effect_id, idempotency_key=key, state=state)
                for effect_id, (key, state) in self._record().effects.items()
            ]
        return list(self.job.effects.order_by("id"))

    @property
    def result(self) -> Any:
        """The job's ``jobs.result`` value (read now), or None if it returned none; a kind
        whose handler is annotated ``-> SomeDataclass`` gets that dataclass back. An
        archived job's result is not kept: None."""
        if self.archived:
            return None
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
        if self.archived:
            return []
        return list(Job.objects.filter(parent=self.job).order_by("pk"))

    @property
    def progress(self) -> JobProgress | None:
        """The progress last written by the job's handler (read now), or None if it never
        reported any. The next attempt of a retried job overwrites it when it reports."""
        if self.archived:
            return None
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

    def _record(self):
        """The archived job's identity record (read with the stand-in)."""
        return self.job.archived_record


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
