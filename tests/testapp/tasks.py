"""``django.tasks`` functions run by ``jobs.backends.JobsBackend`` (settings: TASKS)."""

from __future__ import annotations

try:  # Django 6
    from django.tasks import task
except ImportError:  # Django 5.2: the django-tasks backport
    from django_tasks import task


@task
def add(a: int, b: int) -> dict:
    return {"sum": a + b}


@task(backend="once")
def explode(code: str) -> None:
    raise ValueError(f"exploded with code {code}")


@task(takes_context=True)
def which_attempt(context) -> int:
    return context.attempt


@task
def not_json() -> object:
    return object()


@task
def exits(code: int) -> None:
    import sys

    sys.exit(code)


@task
def worker_pid() -> int:
    import os

    return os.getpid()


@task
async def add_async(a: int, b: int) -> dict:
    return {"sum": a + b}
