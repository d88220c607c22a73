"""A ``django.tasks`` backend: ``@task`` functions run as jobs of the engine.

Django 6 has ``django.tasks`` built in; on Django 5.2 the ``django-tasks`` backport
provides the same API (``pip install django-jobs-ledger[tasks]``)::

    TASKS = {"default": {"BACKEND": "jobs.backends.JobsBackend"}}

    @task
    def send_invoice(order_id: int) -> dict: ...

    result = send_invoice.enqueue(42)                       # a job of kind "jobs.task"
    result = send_invoice.enqueue(42, jobs_identity="order-42")   # twice: one job
    send_invoice.using(run_after=timezone.now() + timedelta(minutes=5)).enqueue(42)

Each enqueue is one job (claim, lease, attempt rows, the retry table). The
result id is the job id. The return value is stored as the job's artifact (JSON,
write-once, sha256-verified). A failure is recorded per attempt as its class, message
and formatted traceback (``jobs.failures``; ``TaskResult.errors``, one per failed
attempt), never the arguments; ``SystemExit`` included, and the worker lives on. The
arguments are stored in ``Job.params``: pass ids, not private data. Arguments and
return values must be JSON (``TypeError`` otherwise, as ``django.tasks`` specifies).

Signals: ``task_enqueued`` when a job is created, ``task_started`` when a worker
starts an attempt, ``task_finished`` once the final outcome is committed (a retry is
not finished); the sender is the backend class. ``async def`` tasks run in an event
loop of their own per call.

``priority`` (Django's -100..100) and ``queue_name`` are the job's: the claim takes a
queue's due jobs by effective priority (docs/app/scheduling.md) and a worker serves the
queues it was started for (``manage.py jobs_worker --queue``). ``QUEUES`` in the
backend's settings still limits the names (Django's own validation).

``jobs_identity=`` (a keyword the function never sees) names the job: a second
enqueue with the same identity returns the first job's result, and one with the
same identity but other arguments raises ``jobs.JobConflict``.

OPTIONS: ``MAX_ATTEMPTS`` (default ``JOBS_MAX_ATTEMPTS``), ``TENANT`` (default "").
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from jobs import api, registry
from jobs.artifacts import open_verified
from jobs.exceptions import JobError, PayloadInvalid
from jobs.models import Attempt, Job
from jobs.retry import classify

try:  # Django 6: the framework is built in
    from django.tasks import TaskContext, TaskResult, TaskResultStatus
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
except ImportError:
    try:  # Django 5.2: the django-tasks backport
        from django_tasks import TaskContext, TaskResult, TaskResultStatus
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskError
        from django_tasks.exceptions import InvalidTaskError as InvalidTask
        from django_tasks.exceptions import TaskResultDoesNotExist
        from django_tasks.signals import task_enqueued, task_finished, task_started
    except ImportError:  # neither: JobsBackend explains what to install
        BaseTaskBackend = None

KIND = "jobs.task"
BACKEND = "jobs.backends.JobsBackend"
IDENTITY_KWARG = "jobs_identity"


def configured_aliases() -> list[str]:
    """The ``TASKS`` aliases that use this backend."""
    tasks = getattr(settings, "TASKS", {}) or {}
    return [alias for alias, cfg in tasks.items() if cfg.get("BACKEND") == BACKEND]


def register_task_kind_if_configured() -> None:
    """Register ``jobs.task`` where a ``TASKS`` backend is this one (and only there)."""
    if configured_aliases():
        registry.register_kind(KIND, run_task)


class TaskFailed(JobError):
    """Raised when a task function raised; keeps the retry class of the original error.

    ``original`` is the task's own exception: its class, message and traceback are
    what the attempt records (``jobs.failures``), not this wrapper's.
    """

    def __init__(
        self, detail: str, *, error_class: str, code: str, retry_after=None, original=None
    ):
        super().__init__(detail, code=code)
        self.error_class = error_class
        self.retry_after = retry_after
        self.original = original


class TaskPayloadInvalid(PayloadInvalid, TypeError):
    """Raised when a task's arguments are not JSON (a ``TypeError``, as ``django.tasks`` says)."""


def normalize_json(obj: Any) -> Any:
    """``obj`` as JSON types (tuples as lists, UTF-8 bytes as text), as ``django.tasks`` does.

    Raises TypeError ("Unsupported type: ...") for anything else.
    """
    if isinstance(obj, Mapping):
        return {normalize_json(k): normalize_json(v) for k, v in obj.items()}
    if isinstance(obj, bytes):
        try:
            return obj.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"Unsupported value: {type(obj)}") from None
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, Sequence):
        return [normalize_json(v) for v in obj]
    raise TypeError(f"Unsupported type: {type(obj)}")


def _load_task(path: str) -> Task:
    try:
        found = import_string(path)
    except (ImportError, AttributeError):
        found = None
    if not isinstance(found, Task):
        raise PayloadInvalid(f"{path} is not a module-level @task function in this project")
    return found


def _failed(exc: Exception, c, what: str) -> TaskFailed:
    path = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return TaskFailed(
        f"{what} {path}"[:300],
        error_class=c.error_class.value,
        code=path[-64:],
        retry_after=c.retry_after,
        original=exc,
    )


# The task this process is running (job id, backend class, result): task_finished is sent
# once the engine has recorded the delivery's outcome (``announce_finished``).
_running: ContextVar[tuple[int, type, Any] | None] = ContextVar("jobs_task_running", default=None)


def run_task(ctx) -> list:
    """The ``jobs.task`` kind: import the task by path, call it, store its return value.

    An ``async def`` task runs in an event loop of its own for this call (``Task.call``).
    """
    p = ctx.params
    task = _enqueued_task(p)
    ctx.check_owner()
    args, kwargs = p.get("args", []), p.get("kwargs", {})
    backend = task.get_backend()
    result = backend.result_for(ctx.job, task) if isinstance(backend, JobsBackend) else None
    if result is not None:
        _running.set((ctx.job.pk, type(backend), task))
        task_started.send(sender=type(backend), task_result=result)
    try:
        if task.takes_context:
            value = task.call(TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
    except JobError:
        raise  # the engine's own errors (PayloadInvalid, TemporaryFailure...) keep their meaning
    except Exception as exc:
        raise _failed(exc, classify(exc), "the task raised") from exc
    try:
        body = json.dumps(normalize_json(value)).encode()
    except (TypeError, ValueError) as exc:
        # Not JSON: the same on every try, so no retry; recorded as the TypeError it is.
        raise _failed(
            exc,
            classify(PayloadInvalid()),
            f"{p['task']} returned a value that is not JSON-serialisable:",
        ) from exc
    ctx.store_artifact(body, content_type="application/json", extension="json")
    return []


_STATUS = {
    Job.State.QUEUED: "READY",
    Job.State.RETRY_WAIT: "READY",
    Job.State.RUNNING: "RUNNING",
    Job.State.SUCCEEDED: "SUCCESSFUL",
    Job.State.FAILED: "FAILED",
    Job.State.DEAD: "FAILED",
    Job.State.CANCELLED: "FAILED",
}


class JobsBackend(BaseTaskBackend or object):
    """Runs ``django.tasks`` tasks as jobs: claim, lease, attempts, the retry table."""

    supports_defer = True
    supports_get_result = True
    supports_async_task = True  # an event loop per call in the worker (``Task.call``)
    supports_priority = True  # the claim's order: effective priority, then due time

    def __init__(self, alias: str, params: dict) -> None:
        if BaseTaskBackend is None:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}] uses {BACKEND}, but neither django.tasks (Django 6) nor "
                "the django-tasks backport is installed: pip install 'django-jobs-ledger[tasks]'"
            )
        super().__init__(alias, params)

    def enqueue(self, task: Task, args, kwargs) -> TaskResult:
        """Ask for the task's job (one per identity) and return its result."""
        self.validate_task(task)
        kwargs = dict(kwargs)
        identity = kwargs.pop(IDENTITY_KWARG, None)
        if identity is None:
            identity = uuid.uuid4().hex
        elif not isinstance(identity, (str, int)) or not 0 < len(str(identity)) <= 64:
            raise PayloadInvalid(f"{IDENTITY_KWARG} must be a string or int of 1 to 64 chars")
        if len(task.module_path) > 100:
            raise PayloadInvalid(f"task path {task.module_path} is longer than 100 chars")
        try:
            args, kwargs = normalize_json(list(args)), normalize_json(kwargs)
        except TypeError as exc:
            raise TaskPayloadInvalid(str(exc)) from None
        handle = api.request(
            KIND,
            (task.module_path, str(identity)),
            params={
                "task": task.module_path,
                "args": args,
                "kwargs": kwargs,
                "backend": self.alias,
                "queue": task.queue_name,
                "priority": task.priority,
                "run_after": task.run_after.isoformat() if task.run_after else None,
            },
            run_after=task.run_after,
            tenant=str(self.options.get("TENANT", "")),
            max_attempts=self.options.get("MAX_ATTEMPTS"),
            priority=task.priority,
            queue=_queue(task.queue_name),
        )
        job, created = handle.job, handle.created
        result = self.result_for(job, task)
        if created:
            task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        job = None
        if str(result_id).isdigit():
            job = Job.objects.filter(pk=int(result_id), kind=KIND).first()
        if job is None:
            raise TaskResultDoesNotExist(result_id)
        try:
            task = _enqueued_task(job.params)
        except PayloadInvalid as exc:
            raise TaskResultDoesNotExist(f"{result_id}: {exc}") from None
        return self.result_for(job, task)

    def result_for(self, job: Job, task: Task) -> TaskResult:
        """The ``TaskResult`` of ``job``: status, times, workers, errors, return value."""
        status = TaskResultStatus[_STATUS[job.state]]
        claims = list(
            Attempt.objects.filter(job=job, number__gt=0)
            .order_by("started_at", "id")
            .values_list("worker", "started_at")
        )
        result = TaskResult(
            task=task,
            id=str(job.pk),
            status=status,
            enqueued_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at if job.is_terminal else None,
            last_attempted_at=claims[-1][1] if claims else None,
            args=job.params.get("args", []),
            kwargs=job.params.get("kwargs", {}),
            backend=job.params.get("backend") or self.alias,
            errors=_errors(job),
            worker_ids=[worker for worker, _ in claims],
        )
        if status == TaskResultStatus.SUCCESSFUL:
            object.__setattr__(result, "_return_value", _return_value(job))
        return result

    def check(self, **kwargs) -> list:
        from django.apps import apps
        from django.core.checks import Error

        if not apps.is_installed("jobs"):
            return [Error(f"{BACKEND} needs 'jobs' in INSTALLED_APPS", id="jobs.E030")]
        return []


def _queue(name: str) -> str:
    """The job queue of a task's ``queue_name`` (Django accepted it: ``QUEUES``); a name
    a broker list cannot carry is refused as Django refuses a task (``InvalidTask``)."""
    try:
        return registry.check_queue(name)
    except ValueError as exc:
        raise InvalidTask(f"queue_name {str(name)[:70]!r}: {exc}") from None


def _enqueued_task(params: dict) -> Task:
    """The task as it was enqueued: queue, ``run_after``, priority and backend alias."""
    task = _load_task(params.get("task", ""))
    changes: dict[str, Any] = {}
    if params.get("queue") and params["queue"] != task.queue_name:
        changes["queue_name"] = params["queue"]
    if params.get("run_after"):
        changes["run_after"] = datetime.fromisoformat(params["run_after"])
    if params.get("priority") not in (None, task.priority):
        changes["priority"] = params["priority"]
    if params.get("backend") and params["backend"] != task.backend:
        changes["backend"] = params["backend"]
    if not changes:
        return task
    return dataclasses.replace(task, **changes)  # as ``Task.using()`` built it


def announce_finished(job_id: int, outcome: str) -> None:
    """Send ``task_finished`` after a delivery of a task's job ended it (then its outcome is
    committed); a delivery that ends in a retry is not finished."""
    running = _running.get()
    _running.set(None)
    if running is None or running[0] != job_id:
        return
    if outcome not in (Attempt.Outcome.SUCCEEDED, Attempt.Outcome.FAILED, Attempt.Outcome.DEAD):
        return
    _, sender, task = running
    job = Job.objects.filter(pk=job_id).first()
    # The kind too: a task's mark left by a delivery that never announced (a test that ran
    # the handler alone) must not pass for another job that has the same id later.
    if job is None or job.kind != KIND or not job.is_terminal:
        return
    result = task.get_backend().result_for(job, task)
    task_finished.send(sender=sender, task_result=result)


def _errors(job: Job) -> list[TaskError]:
    """One TaskError per failed attempt, as Django defines ``TaskResult.errors``.

    Read from the attempt rows, so a task that failed twice and then succeeded still
    shows its two errors (the job's ``last_error_*`` fields are cleared by the success).
    """
    failed = list(
        Attempt.objects.filter(job=job)
        .exclude(error_type="")
        .order_by("started_at", "id")
        .values_list("error_type", "error_traceback")
    )
    if failed:
        return [TaskError(exception_class_path=p, traceback=tb) for p, tb in failed]
    if not job.last_error_class:
        return []
    # The engine gave up without an attempt's exception (e.g. a crashed worker's budget).
    detail = f"{job.last_error_class}/{job.last_error_code}: {job.last_error_detail}"
    return [TaskError(exception_class_path=_ENGINE_ERROR, traceback=detail)]


_ENGINE_ERROR = "jobs.exceptions.JobError"


def _return_value(job: Job) -> Any:
    """The task's return value: the published artifact's bytes, verified (else ArtifactCorrupt;
    StorageUnavailable while the storage cannot be read).

    Streamed through the verified read's spool: parsed only after the whole file matched.
    """
    artifact = job.artifacts.order_by("id").first()
    if artifact is None:
        return None
    with open_verified(artifact) as fh:
        return json.load(fh)
