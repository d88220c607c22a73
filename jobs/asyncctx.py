"""``async def`` kinds: the handler runs in an event loop of its own for each delivery.

The registry wraps an async handler in ``AsyncHandler`` when it is registered, so the
delivery calls every kind the same way (``kind.handler(ctx)``, synchronously) and its
fence, publish and failure table apply unchanged. The handler gets an
``AsyncJobContext``: the same context, with awaitable forms of what does I/O.

The loop: ``asgiref.sync.async_to_sync`` (what Django uses for async views under WSGI)
starts a new event loop for the call and closes it when the handler returns. One loop
per delivery, not one per worker process, because a django-q2 worker runs one task at a
time and calls it synchronously: nothing could share a long-lived loop, and a fresh one
means nothing a handler left behind (a task it did not await, an open client) reaches
the next job. ``async_to_sync`` runs the loop in a helper thread while the worker's
thread serves the handler's ``sync_to_async`` calls (Django's async ORM and this
context's methods): every query runs on the worker's own database connection, where the
fence and the transaction are.

The kind's ``timeout`` stops an async handler at its next ``await`` (``asyncio.timeout``
at the delivery's deadline); a cancel asked for stops it at its next ``await`` within
``CANCEL_POLL_SECONDS``. Both end as for a sync handler: ``JobTimeout`` and
``JobCancelled``, nothing published.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import async_to_sync, sync_to_async

from jobs.exceptions import JobCancelled, JobTimeout

# A ``jobs.JobContext``: the delivery defines it and imports the registry, which imports
# this module, so it is named here and not imported (as in ``jobs.registry``).
JobContext = Any
AsyncHandlerFunc = Callable[["AsyncJobContext"], Awaitable[Any]]

# How often a running async handler's job is looked at for a cancel (one indexed query).
CANCEL_POLL_SECONDS = 1.0


def is_async_handler(handler: object) -> bool:
    """Whether calling ``handler`` gives a coroutine: an ``async def`` function (also
    behind ``functools.partial``) or an object whose ``__call__`` is ``async def``."""
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(type(handler), "__call__", None)  # noqa: B004 (the class's, not a function's)
    return not inspect.isfunction(handler) and inspect.iscoroutinefunction(call)


def refuse_unrunnable(name: str, handler: object) -> None:
    """Raise TypeError for a handler the worker could only fail on every run, naming why.

    An async generator cannot return effects; a plain function that wraps an ``async
    def`` (a decorator that lost the async) would return a coroutine instead of effects.
    """
    where = f"job kind {name!r}: handler {_path(handler)}"
    if inspect.isasyncgenfunction(handler):
        raise TypeError(
            f"{where} is an async generator (async def with yield): a handler returns its "
            "effects (a list), it does not yield them"
        )
    if not callable(handler):
        raise TypeError(f"{where} is not callable")
    inner = inspect.unwrap(handler) if inspect.isfunction(handler) else handler
    if inner is not handler and is_async_handler(inner) and not is_async_handler(handler):
        raise TypeError(
            f"{where} is declared with def but wraps the async def {_path(inner)}: it would "
            "return a coroutine, not effects. Declare the wrapper async def (and await the "
            "wrapped function) or register the async function itself; jobs runs async "
            "handlers on the worker, so no async_to_sync is needed"
        )


def _path(func: object) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


class AsyncHandler:
    """An ``async def`` handler as the worker calls it: ``handler(ctx)`` runs the coroutine
    to its end in a new event loop and returns what it returned."""

    def __init__(self, func: AsyncHandlerFunc):
        self.func = func
        functools.update_wrapper(self, func)  # its name and module, as a declaration shows

    def __call__(self, ctx: JobContext) -> Any:
        return async_to_sync(self._run)(ctx)

    async def _run(self, ctx: JobContext) -> Any:
        actx = AsyncJobContext(ctx)
        handler = asyncio.ensure_future(self.func(actx))
        watcher = asyncio.ensure_future(_watch_cancel(ctx, handler))
        deadline = getattr(ctx, "_deadline", math.inf)
        left = deadline - time.monotonic()
        try:
            async with asyncio.timeout(None if math.isinf(left) else max(left, 0.0)) as timer:
                produced = await handler
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled() and watcher.result():
                raise JobCancelled(f"job {ctx.job.pk}: a cancel was asked for") from None
            raise
        except TimeoutError:
            if timer.expired():
                raise JobTimeout(
                    f"job {ctx.job.pk} ran past its kind's timeout ({ctx.timeout:g} s)"
                ) from None
            raise
        finally:
            watcher.cancel()
        if inspect.isawaitable(produced):
            _close(produced)
            raise _returned_awaitable()
        return produced


async def _watch_cancel(ctx: JobContext, handler: asyncio.Future) -> bool:
    """Cancel ``handler`` (at its next await) once a cancel of its job was asked for."""
    while not handler.done():
        await asyncio.sleep(CANCEL_POLL_SECONDS)
        try:
            asked = await sync_to_async(lambda: ctx.cancelled)()
        except Exception:  # the handler's own next check meets the same error, and reports it
            return False
        if asked:
            handler.cancel()
            return True
    return False


def _close(awaitable: object) -> None:
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()  # no "never awaited" warning in the worker's log


def _returned_awaitable() -> Exception:
    from jobs.exceptions import PayloadInvalid

    return PayloadInvalid(
        "the async handler returned a coroutine (or another awaitable) instead of its "
        "effects: await it before returning"
    )


def refuse_coroutine(produced: object) -> None:
    """Raise PayloadInvalid (validation: failed once, not retried) when a handler declared
    with def returned a coroutine: the work it stands for never ran."""
    if not inspect.isawaitable(produced):
        return
    _close(produced)
    from jobs.exceptions import PayloadInvalid

    raise PayloadInvalid(
        "a job handler declared with def returned a coroutine: its work never ran. "
        "Declare the handler async def (jobs runs async handlers on the worker) or "
        "return its effects"
    )


class AsyncJobContext:
    """What an ``async def`` handler gets: the job and its fence, with awaitable forms of
    the context's calls that read or write (``aread``, ``acheck_owner``, ``astep``, ...).

    Each awaitable runs the context's own method on the worker's thread and connection
    (``sync_to_async``): the same fence, the same statements. ``sync`` is the plain
    context, for code that runs in a thread of its own.
    """

    def __init__(self, ctx: JobContext):
        self.sync = ctx

    # What needs no I/O is read directly.
    @property
    def job(self) -> Any:
        return self.sync.job

    @property
    def params(self) -> dict:
        return self.sync.job.params

    @property
    def worker(self) -> str:
        return self.sync.worker

    @property
    def attempt(self) -> Any:
        return getattr(self.sync, "attempt", None)

    @property
    def artifact(self) -> Any:
        return self.sync.artifact

    @property
    def timeout(self) -> float | None:
        return getattr(self.sync, "timeout", None)

    def step_key(self, name: str) -> str:
        """The idempotency key for an outside call made inside step ``name``."""
        return self.sync.step_key(name)

    async def acheck_owner(self) -> None:
        """``ctx.check_owner()``: raise LeaseLost unless this worker still holds the job."""
        await sync_to_async(self.sync.check_owner)()

    async def aread(self, queryset: Any) -> list:
        """``ctx.read(queryset)``: the rows, read only while this worker holds the job."""
        return await sync_to_async(self.sync.read)(queryset)

    async def aheartbeat(self) -> None:
        """``ctx.heartbeat()``: extend the lease between stages of healthy work."""
        await sync_to_async(self.sync.heartbeat)()

    async def aprogress(self, done: int, total: int | None = None, note: str = "") -> None:
        """``ctx.progress(...)``: how far the work is (counts and a short note)."""
        await sync_to_async(self.sync.progress)(done, total, note)

    async def astage(self, name: str) -> None:
        """``ctx.stage(name)``: mark a stage (test hooks and drills pause or fail here)."""
        await sync_to_async(self.sync.stage)(name)

    async def acancelled(self) -> bool:
        """``ctx.cancelled``: whether a cancel was asked for."""
        return await sync_to_async(lambda: self.sync.cancelled)()

    async def astore_artifact(self, data: bytes, *, content_type: str, extension: str) -> Any:
        """``ctx.store_artifact(...)``: the job's artifact, write-once; its row publishes."""
        return await sync_to_async(self.sync.store_artifact)(
            data, content_type=content_type, extension=extension
        )

    async def astep(
        self, name: str, fn: Callable[[], Any], *, lookup: Callable[[], Any] | None = None
    ) -> Any:
        """``ctx.step(name, fn, lookup=)``: ``fn`` (a function or an ``async def``) runs once
        per job, its JSON output recorded under this worker's fence and returned to later
        attempts; ``lookup`` as ``ctx.step``'s (a function or an ``async def``)."""
        run = async_to_sync(fn) if is_async_handler(fn) else fn
        if lookup is not None and is_async_handler(lookup):
            lookup = async_to_sync(lookup)
        return await sync_to_async(self.sync.step)(name, run, lookup=lookup)

    async def ajoined(self) -> list:
        """``ctx.joined()``: the children of the group this job is the join of."""
        return await sync_to_async(self.sync.joined)()
