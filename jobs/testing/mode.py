"""The testing mode: run what a test asked for in the test's own process, as a worker would.

Two modes, after oban-py's ``testing.mode("inline" | "manual")``:

- inline (``with jobs.testing.run_inline():``): each ``jobs.request``/``jobs.request_many``
  returns after the job it asked for ran and its effects were released;
- manual (the default, nothing to switch on): requests only write their rows; the test
  calls ``jobs.testing.drain()`` when it wants them run.

Either way the work goes through the engine's own entry points: the delivery
(``jobs.delivery.runner.run_delivery``: claim, fence, handler, publish) and the release
(``jobs.delivery.release.release``: the recipient's authorization rechecked, the ledger
row moved, the provider called with the effect's key). What is due is read from the
``Job`` and ``Effect`` rows by their state and due time (``jobs.rules``), not from the
queue's messages, so a test does not depend on how a worker is woken up.

The engine never imports this module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django.db import models

    from jobs.api import JobHandle
    from jobs.models import Effect

__all__ = ["DrainLimitReached", "Drained", "drain", "effects", "requested", "run_inline"]

# How many deliveries and releases one ``drain()`` runs before it gives up: a kind that
# keeps asking for new jobs of itself would otherwise never let the test end.
DRAIN_LIMIT = 1000
# The public entry points ``run_inline`` wraps (the one way to ask for a job, jobs.api).
_ENTRY_POINTS = ("request", "request_many")


class DrainLimitReached(AssertionError):
    """Raised when ``drain()`` still found due work after its limit of runs."""


@dataclass
class Drained:
    """What one ``drain()`` ran: job deliveries and effect releases, with their outcomes."""

    jobs: list[tuple[int, str]] = field(default_factory=list)  # (job id, attempt outcome)
    effects: list[tuple[int, str]] = field(default_factory=list)  # (effect pk, ledger state)

    def __bool__(self) -> bool:
        return bool(self.jobs or self.effects)


_inline_depth = 0  # nested run_inline() blocks: the entry points are wrapped once
_draining = False  # a handler that asks for a job is not drained inside its own delivery


def drain(*, limit: int = DRAIN_LIMIT, worker: str | None = None) -> Drained:
    """Run every job and release every effect that is due now, until none is left.

    Jobs first (most urgent first, as a worker's claim takes them), then effects; a job
    that failed and waits for its retry is not due yet and stays waiting (``requested()``
    shows it ``retry_wait``). A row a run left unchanged (held back by a flow rule, say)
    is not tried again in this call. Raises ``DrainLimitReached`` after ``limit`` runs.
    """
    global _draining
    from jobs.engine.job_machine import worker_identity

    worker = worker or worker_identity()
    done = Drained()
    stuck: dict[str, set[int]] = {"job": set(), "effect": set()}
    outer, _draining = _draining, True
    try:
        for _ in range(limit):
            if not (_run_one_job(worker, done, stuck) or _release_one(worker, done, stuck)):
                return done
    finally:
        _draining = outer
    if _next_due_job(stuck["job"]) is None and _next_due_effect(stuck["effect"]) is None:
        return done
    raise DrainLimitReached(
        f"drain() ran {limit} deliveries and releases and work is still due: does a kind "
        "keep asking for new jobs?"
    )


def _next_due_job(skip: set[int]) -> int | None:
    """The most urgent job a worker's claim would take now (or must decide about)."""
    from jobs import rules
    from jobs.models import Job

    due = rules.to_q(rules.CLAIMABLE) | rules.to_q(rules.OWN_VERDICT)
    rows = Job.objects.filter(due).exclude(pk__in=skip)
    return rows.order_by("-priority", "next_attempt_at", "pk").values_list("pk", flat=True).first()


def _next_due_effect(skip: set[int]) -> Effect | None:
    """The oldest effect a worker would release now."""
    from jobs import rules
    from jobs.models import Effect

    rows = Effect.objects.filter(rules.to_q(rules.EFFECT_RELEASABLE)).exclude(pk__in=skip)
    return rows.select_related("job").order_by("pk").first()


def _mark(model: type[models.Model], pk: int) -> tuple[str, int] | None:
    row = model.objects.filter(pk=pk).values_list("state", "version").first()
    return None if row is None else (row[0], row[1])


def _run_one_job(worker: str, done: Drained, stuck: dict[str, set[int]]) -> bool:
    from jobs import backends
    from jobs.claiming import claims
    from jobs.delivery.runner import run_delivery
    from jobs.models import Job

    job_id = _next_due_job(stuck["job"])
    if job_id is None and claims().release_heads():  # a sequence's head may start now
        job_id = _next_due_job(stuck["job"])
    if job_id is None:
        return False
    before = _mark(Job, job_id)
    result = run_delivery(job_id, worker=worker)
    # What the worker's task does next: a django.tasks task's task_finished, once committed.
    backends.announce_finished(result.job_id, result.outcome)
    done.jobs.append((result.job_id, str(result.outcome)))
    if result.job_id == job_id and _mark(Job, job_id) == before:
        stuck["job"].add(job_id)
    return True


def _release_one(worker: str, done: Drained, stuck: dict[str, set[int]]) -> bool:
    from jobs.delivery.release import release
    from jobs.models import Effect

    effect = _next_due_effect(stuck["effect"])
    if effect is None:
        return False
    before = (effect.state, effect.version)
    outcome = release(effect, worker)
    done.effects.append((effect.pk, str(outcome)))
    if _mark(Effect, effect.pk) == before:
        stuck["effect"].add(effect.pk)
    return True


@contextlib.contextmanager
def run_inline(*, limit: int = DRAIN_LIMIT) -> Iterator[None]:
    """Run each job when ``jobs.request`` (or ``request_many``) asks for it, then release
    its effects: the call returns once they are done, in the test's process.

    A context manager and a decorator. Inside it every request drains what is due
    (``drain()``), so follow-ups and jobs other code asked for run too; a job asked for
    by a handler runs after that handler's delivery, never inside it. The job runs in
    the caller's transaction when there is one (a ``TestCase`` is one).
    """
    global _inline_depth
    if _inline_depth == 0:
        originals = _wrap_entry_points(limit)
    _inline_depth += 1
    try:
        yield
    finally:
        _inline_depth -= 1
        if _inline_depth == 0:
            _restore_entry_points(originals)


def _wrap_entry_points(limit: int) -> dict[str, Callable[..., Any]]:
    import jobs
    import jobs.api

    originals = {name: getattr(jobs.api, name) for name in _ENTRY_POINTS}
    for name, original in originals.items():
        wrapped = _draining_after(original, limit)
        setattr(jobs.api, name, wrapped)
        setattr(jobs, name, wrapped)  # ``jobs.request`` is looked up on the package
    return originals


def _restore_entry_points(originals: dict[str, Callable[..., Any]]) -> None:
    import jobs
    import jobs.api

    for name, original in originals.items():
        setattr(jobs.api, name, original)
        setattr(jobs, name, original)


def _draining_after(entry: Callable[..., Any], limit: int) -> Callable[..., Any]:
    @functools.wraps(entry)
    def asked_and_run(*args: Any, **kwargs: Any) -> Any:
        asked = entry(*args, **kwargs)
        if _draining:  # a handler asked: the drain running it takes the new job next
            return asked
        drain(limit=limit)
        return _refreshed(asked)

    return asked_and_run


def _refreshed(asked: Any) -> Any:
    """The handle(s) the request returned, read again: they show how the job ended."""
    if isinstance(asked, list):
        return [_refreshed(handle) for handle in asked]
    refresh = getattr(asked, "refresh", None)
    return refresh() if callable(refresh) else asked


def requested(
    kind: str | None = None,
    *,
    subject: models.Model | tuple[str, str | int] | None = None,
    state: str | None = None,
) -> list[JobHandle]:
    """The jobs asked for (oldest first), as handles: what a test asserts was requested."""
    from jobs.api import JobHandle, subject_reference
    from jobs.models import Job

    rows = Job.objects.all()
    if kind is not None:
        rows = rows.filter(kind=kind)
    if subject is not None:
        subject_type, subject_id = subject_reference(subject)
        rows = rows.filter(subject_type=subject_type, subject_id=subject_id)
    if state is not None:
        rows = rows.filter(state=state)
    return [JobHandle(job) for job in rows.order_by("pk")]


def effects(
    kind: str | None = None,
    *,
    name: str | None = None,
    provider: str | None = None,
    recipient: str | int | None = None,
    state: str | None = None,
) -> list[Effect]:
    """The ledger rows (oldest first): what the jobs asked to send and how each ended
    (``applied`` sent, ``withheld`` refused by the release check, ...)."""
    from jobs.models import Effect

    rows = Effect.objects.select_related("job")
    if kind is not None:
        rows = rows.filter(job__kind=kind)
    if name is not None:
        rows = rows.filter(name=name)
    if provider is not None:
        rows = rows.filter(provider=provider)
    if recipient is not None:
        rows = rows.filter(recipient=str(recipient))
    if state is not None:
        rows = rows.filter(state=state)
    return list(rows.order_by("pk"))
