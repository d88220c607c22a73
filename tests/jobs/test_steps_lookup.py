"""A durable step with a ``lookup`` (issue 43): begun before its ``fn`` runs, and an
attempt that finds it begun but not finished asks the outside world before calling again.

The step's call goes to the stand-in provider on loopback (``POST /notices`` under the
step's key); the lookup asks it ``GET /notices/{key}``. The stand-in records sends and
lookups apart, so each test counts the POSTs the provider really got for the key.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from jobs import identity
from jobs.delivery import steps
from jobs.delivery.runner import run_delivery
from jobs.models import Attempt, Job, JobStep
from jobs.registry import kinds, register_kind
from jobs.testing.fakeprovider import Faults, start_in_thread
from tests.jobs.helpers import Crash, expire_lease, make_due, request_job

pytestmark = pytest.mark.django_db(transaction=True)

KIND = "test.step_with_lookup"
TOKEN = "steps-token"
RUNS: Counter = Counter()  # (subject, what) -> times it ran


def _call(ctx, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TOKEN}", **kwargs.pop("headers", {})}
    with httpx.Client(timeout=5) as client:
        return client.request(method, ctx.params["provider"] + path, headers=headers, **kwargs)


def _handler(ctx):
    subject = ctx.job.subject_id
    key = ctx.step_key("send")

    def send() -> dict:
        RUNS[subject, "send"] += 1
        body = {
            "effect_id": key,
            "recipient": "1",
            "job": ctx.job.pk,
            "revision": ctx.job.output_revision,
            "report_key": f"job-{ctx.job.pk}",
            "kind": KIND,
        }
        answer = _call(ctx, "POST", "/notices", json=body, headers={"Idempotency-Key": key})
        answer.raise_for_status()
        return {"send_id": answer.json()["id"]}

    def look_up() -> dict | None:
        RUNS[subject, "lookup"] += 1
        answer = _call(ctx, "GET", f"/notices/{key}")
        if answer.status_code == 404:
            return None
        answer.raise_for_status()  # the provider could not say: the attempt is retried
        return {"send_id": answer.json()["id"]}

    # ``ctx.step(name, fn, lookup=...)`` once the runner passes it on; the same function.
    sent = steps.run(ctx, "send", send, lookup=look_up if ctx.params["lookup"] else None)
    ctx.store_artifact(
        f"send={sent['send_id']}\n".encode(), content_type="text/plain", extension="txt"
    )
    return []


if KIND not in kinds():
    register_kind(KIND, _handler, max_attempts=4)


@pytest.fixture
def provider(tmp_path):
    server = start_in_thread(tmp_path / "provider.sqlite3", token=TOKEN, faults=Faults(seed=43))
    yield server
    server.stop()


def _job(subject: str, provider, *, lookup: bool) -> Job:
    job, _ = request_job(
        KIND,
        subject_type="test",
        subject_id=subject,
        params={"provider": provider.url, "lookup": lookup},
    )
    return job


def _crash_at(stage_name: str):
    def crash(stage, ctx):
        if stage == stage_name and ctx.job.attempts == 1:
            raise Crash(stage)

    return crash


def _first_attempt_dies(job: Job, stage_name: str) -> None:
    with pytest.raises(Crash):
        run_delivery(job.pk, worker="w-1", on_stage=_crash_at(stage_name))
    expire_lease(Job.objects.get(pk=job.pk))


def _step_key(job: Job) -> str:
    return f"job-{identity.job_key(job)}-r1-step-send"


def _posts(provider, job: Job) -> list[int]:
    return [r["status"] for r in provider.record.requests_for(_step_key(job))]


def _lookups(provider, job: Job) -> list[int]:
    return [r["status"] for r in provider.record.lookups_for(_step_key(job))]


@pytest.mark.parametrize("lookup", [True, False])
def test_step_lookup__a_call_that_landed_before_the_crash_is_found_not_made_again(provider, lookup):
    """The attempt dies after its call and before its record. With a lookup the next
    attempt finds the call's outcome (1 POST); without, it calls again (2 POSTs)."""
    subject = f"landed-{lookup}"
    job = _job(subject, provider, lookup=lookup)
    _first_attempt_dies(job, "step_done:send")
    if lookup:
        begun = JobStep.objects.get(job=job, name="send")
        assert (begun.finished_at, begun.output, begun.worker) == (None, None, "w-1")

    assert run_delivery(job.pk, worker="w-2").outcome == Attempt.Outcome.SUCCEEDED
    step = JobStep.objects.get(job=job, name="send")
    (applied,) = provider.record.sends()
    assert step.output == {"send_id": applied["send_id"]} and step.finished_at is not None
    assert (step.attempt, step.worker) == (2, "w-2")
    seen = {"posts": _posts(provider, job), "lookups": _lookups(provider, job)}
    print(f"lookup={lookup}: provider requests for the step's key {seen}")
    if lookup:
        assert seen == {"posts": [201], "lookups": [200]}, "found: no second POST"
        assert (RUNS[subject, "send"], RUNS[subject, "lookup"]) == (1, 1)
    else:
        assert seen == {"posts": [201, 200], "lookups": []}, "today: the fn ran again"
        assert RUNS[subject, "send"] == 2


def test_step_lookup__a_crash_before_the_call_is_not_found_and_the_fn_runs_once(provider):
    job = _job("before-call", provider, lookup=True)
    _first_attempt_dies(job, "step_started:send")  # begun, the fn never ran
    assert run_delivery(job.pk, worker="w-2").outcome == Attempt.Outcome.SUCCEEDED
    assert (_posts(provider, job), _lookups(provider, job)) == ([201], [404])
    assert RUNS["before-call", "send"] == 1


def test_step_lookup__a_lookup_that_fails_runs_nothing_and_the_job_retries(provider):
    job = _job("lookup-fails", provider, lookup=True)
    _first_attempt_dies(job, "step_done:send")
    provider.faults.lookup_unavailable, provider.faults.retry_after = 1.0, 0

    assert run_delivery(job.pk, worker="w-2").outcome == Attempt.Outcome.RETRY
    job.refresh_from_db()
    assert job.last_error_class == "temporary", "the table decided (503): retried later"
    assert JobStep.objects.get(job=job, name="send").finished_at is None
    assert _posts(provider, job) == [201], "never a blind second call"

    provider.faults.lookup_unavailable = 0.0
    make_due(job)
    assert run_delivery(job.pk, worker="w-3").outcome == Attempt.Outcome.SUCCEEDED
    assert (_posts(provider, job), _lookups(provider, job)) == ([201], [503, 200])
    assert RUNS["lookup-fails", "send"] == 1


def test_step_lookup__a_step_without_lookup_writes_no_begun_row(provider):
    """No lookup, no extra write: the record is the one row, as before."""
    job = _job("plain", provider, lookup=False)
    _first_attempt_dies(job, "step_done:send")
    assert not JobStep.objects.filter(job=job).exists()
