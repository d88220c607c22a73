"""Typed results: a handler annotated ``-> MyResult`` (a dataclass or a TypedDict) returns
it, the publish stores it as the job's JSON result, and ``registry.load_result`` gives the
dataclass back."""

from __future__ import annotations

import dataclasses
import datetime
from typing import TypedDict

import pytest

import jobs
from jobs import registry
from jobs.delivery.runner import run_delivery
from jobs.models import Attempt, Effect, Job
from tests.jobs.helpers import request_job

pytestmark = pytest.mark.django_db


@dataclasses.dataclass(frozen=True)
class Totals:
    orders: int
    amount: str


class Counted(TypedDict):
    rows: int


@dataclasses.dataclass
class Stamped:
    at: datetime.datetime  # not JSON


def _totals(ctx: jobs.JobContext) -> Totals:
    ctx.check_owner()
    return Totals(orders=3, amount="42.00")


async def _async_totals(ctx: jobs.AsyncJobContext) -> Totals:
    await ctx.acheck_owner()
    return Totals(orders=1, amount="7.00")


def _counted(ctx: jobs.JobContext) -> Counted:
    return {"rows": 12}


def _stamped(ctx: jobs.JobContext) -> Stamped:
    return Stamped(at=datetime.datetime(2026, 12, 2, tzinfo=datetime.UTC))


def _effects_and_result(ctx: jobs.JobContext) -> list[jobs.EffectSpec]:
    recipient = str(ctx.params["user"])
    return [jobs.EffectSpec("done", "inapp", recipient), jobs.result(Totals(2, "1.00"))]


registry.register_kind("test.typed.totals", _totals)
registry.register_kind("test.typed.async_totals", _async_totals)
registry.register_kind("test.typed.counted", _counted)
registry.register_kind("test.typed.stamped", _stamped)
registry.register_kind("test.typed.list", _effects_and_result)


def _run(kind: str, **params) -> Job:
    job, _ = request_job(kind, subject_type="test", subject_id=1, params=params)
    run_delivery(job.pk, worker="w-typed")
    job.refresh_from_db()
    return job


@pytest.mark.parametrize(
    ("kind", "stored", "loaded"),
    [
        ("test.typed.totals", {"orders": 3, "amount": "42.00"}, Totals(3, "42.00")),
        ("test.typed.async_totals", {"orders": 1, "amount": "7.00"}, Totals(1, "7.00")),
        ("test.typed.counted", {"rows": 12}, {"rows": 12}),
    ],
)
def test_typed_result__stored_as_json_and_loaded_as_declared(kind, stored, loaded):
    job = _run(kind)
    assert job.state == Job.State.SUCCEEDED
    handle = jobs.JobHandle(job)
    assert job.result == stored, "stored as JSON"
    assert handle.result == loaded, "the handle gives it back as the kind declared it"
    assert registry.load_result(kind, job.result) == loaded
    assert registry.get_kind(kind).result_type in (Totals, Counted)


def test_typed_result__a_dataclass_in_jobs_result_beside_effects(make_user):
    user = make_user()
    job = _run("test.typed.list", user=user.pk)
    assert job.state == Job.State.SUCCEEDED
    assert jobs.JobHandle(job).result == {"orders": 2, "amount": "1.00"}
    assert Effect.objects.filter(job=job).count() == 1
    assert registry.get_kind("test.typed.list").result_type is None  # -> list: not wrapped
    assert registry.get_kind("test.typed.list").handler is _effects_and_result


def test_typed_result__not_json_fails_once_as_validation():
    job = _run("test.typed.stamped")
    assert (job.state, job.attempts, job.last_error_class) == (Job.State.FAILED, 1, "validation")
    assert "JSON-serialisable" in Attempt.objects.get(job=job).error_message


def test_typed_result__the_declaration_keeps_its_name_and_may_repeat():
    handler = registry.get_kind("test.typed.totals").handler
    assert isinstance(handler, registry.TypedResultHandler)
    assert (handler.__module__, handler.__qualname__) == (__name__, "_totals")
    jobs.kind("test.typed.totals")(_totals)  # a second ready(): the same function
    registry.register_kind("test.typed.totals", handler)  # re-registered: not wrapped twice
    assert registry.get_kind("test.typed.totals").handler.handler is _totals


def test_load_result__unknown_kind_or_no_result_is_left_alone():
    assert registry.load_result("no.such.kind", {"a": 1}) == {"a": 1}
    assert registry.load_result("test.typed.totals", None) is None
