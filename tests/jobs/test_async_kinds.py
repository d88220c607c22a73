"""``async def`` kinds (``jobs.asyncctx``): run by the delivery in an event loop of their own,
with the same fence (``await ctx.aread``, ``ctx.acheck_owner``, ``ctx.astep``), stopped at
an ``await`` by their timeout or a cancel; handlers that could only fail are refused.

In-process through ``run_delivery``, on PostgreSQL and on SQLite (``make test-sqlite``)."""

from __future__ import annotations

import asyncio
import functools
import time
import warnings

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from django.test import TestCase

import jobs
import jobs.testing
from jobs import asyncctx, registry
from jobs.delivery.runner import run_delivery
from jobs.exceptions import TemporaryFailure
from jobs.models import Artifact, Attempt, Effect, Job, JobStep
from tests.jobs.helpers import make_due, request_job

pytestmark = pytest.mark.django_db

CALLS: list[str] = []


async def _report(ctx: jobs.AsyncJobContext) -> list[jobs.EffectSpec]:
    """The sync kinds' shape, awaited: a fenced read, a durable step, an artifact, a notice."""
    CALLS.append("ran")
    users = await ctx.aread(get_user_model().objects.filter(pk=ctx.params["user"]))
    # Django's async ORM: on the worker's connection too (it sees this test's rows).
    same = await get_user_model().objects.aget(pk=ctx.params["user"])
    assert users == [same]
    total = await ctx.astep("count", _count)
    await ctx.aprogress(1, 2, "counted")
    await ctx.aheartbeat()
    await ctx.astore_artifact(f"{total}\n".encode(), content_type="text/plain", extension="txt")
    if ctx.params.get("fail_once") and ctx.job.attempts == 1:
        raise TemporaryFailure("the dependency is down", code="down")
    return [jobs.EffectSpec("report-ready", "inapp", str(users[0].pk), {"title": "ready"})]


async def _count() -> int:
    CALLS.append("step")
    await asyncio.sleep(0)
    return 42


async def _sleeps(ctx: jobs.AsyncJobContext) -> list:
    await ctx.acheck_owner()
    await asyncio.sleep(float(ctx.params.get("sleep", 10)))
    return []


async def _cancels_itself_then_sleeps(ctx: jobs.AsyncJobContext) -> list:
    await sync_to_async(jobs.cancel)(ctx.job.pk)  # as an operator would, from elsewhere
    await asyncio.sleep(10)
    return []


async def _loses_its_lease(ctx: jobs.AsyncJobContext) -> list:
    # Another worker reclaimed the job (its lease ran out while this one waited).
    await Job.objects.filter(pk=ctx.job.pk).aupdate(lease_owner="other-worker")
    await ctx.acheck_owner()
    return []


async def _forgets_to_await(ctx: jobs.AsyncJobContext):
    return _report(ctx)  # the coroutine, not its effects


def _sync_returning_coroutine(ctx):
    return _report(ctx)


class _CallableKind:
    async def __call__(self, ctx: jobs.AsyncJobContext) -> list:
        await ctx.acheck_owner()
        return []


registry.register_kind("test.async.report", _report, max_attempts=3)
registry.register_kind("test.async.sleeps", _sleeps, timeout=0.3)
registry.register_kind("test.async.cancels", _cancels_itself_then_sleeps)
registry.register_kind("test.async.lease", _loses_its_lease)
registry.register_kind("test.async.forgets", _forgets_to_await)
registry.register_kind("test.async.sync_coroutine", _sync_returning_coroutine)
registry.register_kind("test.async.callable", _CallableKind())


def _job(kind: str, subject: object = 1, **params) -> Job:
    job, _ = request_job(kind, subject_type="test", subject_id=subject, params=params)
    return job


def test_async_kind__runs_once_with_its_fenced_read_step_artifact_and_effect(make_user):
    CALLS.clear()
    user = make_user()
    job = _job("test.async.report", user=user.pk)
    result = run_delivery(job.pk, worker="w-async")
    assert result.outcome == Attempt.Outcome.SUCCEEDED, result
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED
    assert Artifact.objects.get(job=job).size == 3
    assert [(e.name, e.state) for e in Effect.objects.filter(job=job)] == [
        ("report-ready", "applied")
    ]
    assert JobStep.objects.get(job=job, name="count").output == 42
    assert CALLS == ["ran", "step"]
    # A second delivery of the finished job runs nothing.
    assert run_delivery(job.pk, worker="w-async").outcome != Attempt.Outcome.SUCCEEDED
    assert CALLS == ["ran", "step"]


def test_async_kind__a_retry_reuses_the_recorded_step(make_user):
    CALLS.clear()
    user = make_user()
    job = _job("test.async.report", user=user.pk, fail_once=True)
    assert run_delivery(job.pk, worker="w-async").outcome == Attempt.Outcome.RETRY
    job.refresh_from_db()
    assert (job.state, job.last_error_class) == (Job.State.RETRY_WAIT, "temporary")
    make_due(job)
    assert run_delivery(job.pk, worker="w-async").outcome == Attempt.Outcome.SUCCEEDED
    assert CALLS == ["ran", "step", "ran"]  # the step's output came from the first attempt
    assert Effect.objects.filter(job=job).count() == 1


def test_async_kind__its_timeout_stops_it_at_the_next_await(settings):
    settings.JOBS_LEASE_SECONDS = 60
    settings.JOBS_TIMEOUT_GRACE_SECONDS = 30  # the hard stop cannot be what ends it
    job = _job("test.async.sleeps", sleep=10)
    began = time.monotonic()
    result = run_delivery(job.pk, worker="w-async")
    took = time.monotonic() - began
    assert result.outcome == Attempt.Outcome.RETRY, result
    assert took < 3, f"the 10 s sleep ran {took:.1f} s: the timeout did not stop it"
    job.refresh_from_db()
    assert (job.last_error_class, job.last_error_code) == ("temporary", "timeout")


def test_async_kind__a_cancel_stops_it_at_the_next_await(monkeypatch):
    monkeypatch.setattr(asyncctx, "CANCEL_POLL_SECONDS", 0.05)
    job = _job("test.async.cancels")
    began = time.monotonic()
    result = run_delivery(job.pk, worker="w-async")
    assert time.monotonic() - began < 3
    assert result.outcome == Attempt.Outcome.CANCELLED, result
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED


def test_async_kind__a_lost_lease_publishes_nothing():
    job = _job("test.async.lease")
    result = run_delivery(job.pk, worker="w-async")
    assert result.outcome == Attempt.Outcome.LEASE_LOST, result
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING and job.lease_owner == "other-worker"


def test_async_kind__an_object_with_async_call_is_run():
    assert isinstance(registry.get_kind("test.async.callable").handler, asyncctx.AsyncHandler)
    job = _job("test.async.callable")
    assert run_delivery(job.pk, worker="w-async").outcome == Attempt.Outcome.SUCCEEDED


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("test.async.sync_coroutine", "declared with def returned a coroutine"),
        ("test.async.forgets", "await it before returning"),
    ],
)
def test_async_kind__a_coroutine_returned_fails_once_as_validation(kind, says):
    job = _job(kind, user=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "never awaited" left behind
        result = run_delivery(job.pk, worker="w-async")
    assert result.outcome == Attempt.Outcome.FAILED, result
    job.refresh_from_db()
    assert (job.state, job.attempts, job.last_error_class) == (Job.State.FAILED, 1, "validation")
    assert says in Attempt.objects.get(job=job).error_message


def test_register__a_def_that_wraps_an_async_def_is_refused():
    def lost_its_async(func):
        @functools.wraps(func)
        def wrapper(ctx):
            return func(ctx)

        return wrapper

    with pytest.raises(TypeError, match=r"declared with def but wraps the async def .*_report"):
        registry.register_kind("test.async.wrapped", lost_its_async(_report))
    assert "test.async.wrapped" not in registry.kinds()


def test_register__an_async_generator_is_refused():
    async def yields(ctx):
        yield []

    with pytest.raises(TypeError, match="async generator"):
        jobs.kind("test.async.generator")(yields)


def test_register__the_declaration_keeps_its_name_and_may_repeat():
    handler = registry.get_kind("test.async.report").handler
    assert isinstance(handler, asyncctx.AsyncHandler)
    assert (handler.__module__, handler.__qualname__) == (__name__, "_report")
    jobs.kind("test.async.report", max_attempts=3)(_report)  # a second ready(): same function
    registry.register_kind("test.async.report", handler, max_attempts=3)  # not wrapped twice
    assert registry.get_kind("test.async.report").handler.func is _report


class AsyncTestDrains(TestCase):
    """docs/app/testing.md: from an async test, the testing mode runs through sync_to_async."""

    async def test_async_test__drains_an_async_kind(self):
        user = await get_user_model().objects.acreate(username="async-test")
        handle = await sync_to_async(jobs.request)(
            "test.async.report", user, params={"user": user.pk}
        )
        done = await sync_to_async(jobs.testing.drain)()
        self.assertEqual(done.jobs, [(handle.id, "succeeded")])
        state = await Job.objects.filter(pk=handle.id).values_list("state", flat=True).aget()
        self.assertEqual(state, "succeeded")
