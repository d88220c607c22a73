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
write-once, sha256-verified); an exception is recorded as its class path and
message (``Job.last_error_detail``, 300 characters), never a traceback or the
arguments. The arguments are stored in ``Job.params``: pass ids, not private data.

``jobs_identity=`` (a keyword the function never sees) names the job: a second
enqueue with the same identity returns the first job's result, and one with the
same identity but other arguments raises ``jobs.JobConflict``.

OPTIONS: ``MAX_ATTEMPTS`` (default ``JOBS_MAX_ATTEMPTS``), ``TENANT`` (default "").
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from jobs import api, registry
from jobs.artifacts import get_storage
from jobs.exceptions import JobError, PayloadInvalid
from jobs.models import Attempt, Job
from jobs.retry import classify

try:  # Django 6: the framework is built in
    from django.tasks import TaskContext, TaskResult, TaskResultStatus
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued
except ImportError:
    try:  # Django 5.2: the django-tasks backport
        from django_tasks import TaskContext, TaskResult, TaskResultStatus
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskError
        from django_tasks.exceptions import TaskResultDoesNotExist
        from django_tasks.signals import task_enqueued
    except ImportError:  # neither: JobsBackend explains what to install
        BaseTaskBackend = None

KIND = "jobs.task"
BACKEND = "jobs.backends.JobsBackend"
IDENTITY_KWARG = "jobs_identity"
_PATH_PREFIX = re.compile(r"^([A-Za-z_][\w.]*): ")


def configured_aliases() -> list[str]:
    """The ``TASKS`` aliases that use this backend."""
    tasks = getattr(settings, "TASKS", {}) or {}
    return [alias for alias, cfg in tasks.items() if cfg.get("BACKEND") == BACKEND]


def register_task_kind_if_configured() -> None:
    """Register ``jobs.task`` where a ``TASKS`` backend is this one (and only there)."""
    if configured_aliases():
        registry.register_kind(KIND, run_task)


class TaskFailed(JobError):
    """Raised when a task function raised; keeps the retry class of the original error."""

    def __init__(self, detail: str, *, error_class: str, code: str, retry_after=None):
        super().__init__(detail, code=code)
        self.error_class = error_class
        self.retry_after = retry_after


def _load_task(path: str) -> Task:
    try:
        found = import_string(path)
    except (ImportError, AttributeError):
        found = None
    if not isinstance(found, Task):
        raise PayloadInvalid(f"{path} is not a module-level @task function in this project")
    return found


def run_task(ctx) -> list:
    """The ``jobs.task`` kind: import the task by path, call it, store its return value."""
    p = ctx.params
    task = _load_task(p["task"])
    ctx.check_owner()
    args, kwargs = p.get("args", []), p.get("kwargs", {})
    try:
        if task.takes_context:
            result = task.get_backend().result_for(ctx.job, task)
            value = task.call(TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
    except JobError:
        raise  # the engine's own errors (PayloadInvalid, TemporaryFailure...) keep their meaning
    except Exception as exc:
        c = classify(exc)
        path = f"{type(exc).__module__}.{type(exc).__qualname__}"
        raise TaskFailed(
            f"{path}: {exc}"[:300],
            error_class=c.error_class.value,
            code=path[-64:],
            retry_after=c.retry_after,
        ) from exc
    try:
        body = json.dumps(value).encode()
    except (TypeError, ValueError):
        raise PayloadInvalid(
            f"{p['task']} returned a {type(value).__name__}, which is not JSON-serialisable"
        ) from None
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
    supports_async_task = False
    supports_priority = False

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
        job, created = api.obtain(
            KIND,
            subject_type=task.module_path,
            subject_id=str(identity),
            params={
                "task": task.module_path,
                "args": list(args),
                "kwargs": kwargs,
                "backend": self.alias,
                "queue": task.queue_name,
            },
            run_after=task.run_after,
            tenant_key=str(self.options.get("TENANT", "")),
            max_attempts=self.options.get("MAX_ATTEMPTS"),
        )
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
            task = _load_task(job.params.get("task", ""))
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
            backend=self.alias,
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


def _errors(job: Job) -> list[TaskError]:
    """The last failure as a TaskError: class path and message (no traceback is kept)."""
    if not job.last_error_class:
        return []
    detail = job.last_error_detail
    match = _PATH_PREFIX.match(detail)
    path = match.group(1) if match else "jobs.exceptions.JobError"
    text = detail if match else f"{job.last_error_class}/{job.last_error_code}: {detail}"
    return [TaskError(exception_class_path=path, traceback=text)]


def _return_value(job: Job) -> Any:
    artifact = job.artifacts.order_by("id").first()
    if artifact is None:
        return None
    with get_storage().open(artifact.storage_name, "rb") as fh:
        return json.loads(fh.read())
