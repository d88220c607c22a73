"""Durable steps (``ctx.step``): a step's ``fn`` runs once per job across attempts, its
output is written once by a worker that held the job, and a worker that lost the job
records nothing (its step and its publish are refused).

The stale worker is made without threads: inside its step, the test expires its lease and
lets a second worker (another identity) claim and finish the job, then the first goes
on. That is the DBOS scenario (tests/e2e/test_steps_processes.py runs it with real
processes and SIGSTOP)."""

from __future__ import annotations

from collections import Counter

import pytest

import jobs
from jobs import identity
from jobs.delivery import steps as steps_module
from jobs.delivery.runner import claim_for, run_delivery
from jobs.delivery.steps import OUTPUT_MAX_BYTES
from jobs.models import Artifact, Attempt, Effect, Job, JobStep
from jobs.registry import EffectSpec, kinds, register_kind
from tests.jobs.helpers import Crash, expire_lease, make_due, request_job

pytestmark = pytest.mark.django_db(transaction=True)

KIND = "test.two_steps"
RUNS: Counter = Counter()  # (subject, step) -> times fn ran
INSIDE: dict[str, callable] = {}  # subject -> what the test does inside step 2's fn


def _handler(ctx):
    subject = ctx.job.subject_id

    def render():
        RUNS[subject, "render"] += 1
        return {"pages": 3, "attempt": ctx.job.attempts}

    def expensive():
        RUNS[subject, "expensive"] += 1
        if subject in INSIDE:
            INSIDE.pop(subject)(ctx)
        return {"key": ctx.step_key("expensive")}

    rendered = ctx.step("render", render)
    if ctx.params.get("fail_after_render") == ctx.job.attempts:
        raise jobs.TemporaryFailure("the test's dependency is away", code="test_unavailable")
    sent = ctx.step("expensive", expensive)
    ctx.store_artifact(
        f"pages={rendered['pages']} key={sent['key']}\n".encode(),
        content_type="text/plain",
        extension="txt",
    )
    return [EffectSpec("done", "inapp", str(ctx.params["user"]), {"title": "Done"})]


def _bad_output(ctx):
    if ctx.params["bad"] == "object":
        return ctx.step("render", lambda: object())
    if ctx.params["bad"] == "nan":
        return ctx.step("render", lambda: {"ratio": float("nan")})
    return ctx.step("render", lambda: "x" * (OUTPUT_MAX_BYTES + 1))


SEEN: dict[tuple[str, int], object] = {}  # (subject, attempt) -> what ctx.step returned


def _json_shapes(ctx):
    out = ctx.step("render", lambda: {1: (2, 3), "page": 4})
    SEEN[ctx.job.subject_id, ctx.job.attempts] = out
    if ctx.job.attempts == 1:
        raise jobs.TemporaryFailure("the test's dependency is away", code="test_unavailable")
    return []


if KIND not in kinds():
    register_kind(KIND, _handler, max_attempts=3)
    register_kind("test.bad_step_output", _bad_output)
    register_kind("test.step_json_shapes", _json_shapes, max_attempts=3)
    # The same two steps under a kind timeout (far off: the test moves the deadline).
    # 4 s: below the suite's Q_CLUSTER timeout (5), or jobs.E007 fails every `check` here.
    register_kind("test.two_steps_timed", _handler, max_attempts=3, timeout=4)


def _job(user, subject: str, **params) -> Job:
    job, _ = request_job(
        KIND, subject_type="test", subject_id=subject, params={"user": user.pk, **params}
    )
    return job


def test_step__a_retry_reuses_the_done_step_and_runs_only_the_rest(make_user):
    user = make_user()
    job = _job(user, "retry", fail_after_render=1)
    assert run_delivery(job.pk, worker="w-1").outcome == Attempt.Outcome.RETRY
    make_due(Job.objects.get(pk=job.pk))
    assert run_delivery(job.pk, worker="w-2").outcome == Attempt.Outcome.SUCCEEDED
    assert RUNS["retry", "render"] == 1 and RUNS["retry", "expensive"] == 1
    steps = {s.name: s for s in JobStep.objects.filter(job=job)}
    assert steps["render"].output == {"pages": 3, "attempt": 1}
    assert (steps["render"].attempt, steps["render"].worker) == (1, "w-1")
    assert (steps["expensive"].attempt, steps["expensive"].worker) == (2, "w-2")
    assert steps["expensive"].output == {"key": f"job-{identity.job_key(job)}-r1-step-expensive"}
    assert Artifact.objects.filter(job=job).count() == 1
    assert Effect.objects.filter(job=job).count() == 1


def test_step__the_job_page_lists_each_step_with_its_attempt(make_user, admin_client):
    user = make_user()
    job = _job(user, "page", fail_after_render=1)
    run_delivery(job.pk, worker="w-1")
    make_due(Job.objects.get(pk=job.pk))
    run_delivery(job.pk, worker="w-2")
    page = admin_client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert "Steps (each done once; later attempts reuse its output)" in page
    rows = page.split("Steps (each done once")[1]
    assert rows.index("render") < rows.index("expensive")
    assert "w-1" in rows and "w-2" in rows
    assert f"job-{identity.job_key(job)}-r1-step-expensive" not in page  # outputs stay off the page


def test_step__a_stale_worker_cannot_record_its_step_or_publish(make_user, settings, monkeypatch):
    """Worker A pauses inside step 2 after its outside call; its lease runs out; B claims,
    reuses step 1, runs step 2 and publishes; then A goes on: refused, nothing written.
    (Each step is recorded at its end here, as a step of a second's work is.)"""
    monkeypatch.setattr(steps_module, "RIDE_SECONDS", 0.0)
    settings.JOBS_LEASE_SECONDS = 30
    user = make_user()
    job = _job(user, "stale")
    seen = {}

    def take_over(ctx_a):
        expire_lease(Job.objects.get(pk=ctx_a.job.pk))
        seen["b"] = run_delivery(ctx_a.job.pk, worker="w-B")
        seen["version_after_b"] = Job.objects.get(pk=ctx_a.job.pk).version

    INSIDE["stale"] = take_over
    a = run_delivery(job.pk, worker="w-A")

    assert seen["b"].outcome == Attempt.Outcome.SUCCEEDED
    assert a.outcome == Attempt.Outcome.LEASE_LOST
    assert RUNS["stale", "render"] == 1, "step 1's fn ran once in all"
    assert RUNS["stale", "expensive"] == 2, "A's call and B's: the same step key"
    steps = {s.name: s for s in JobStep.objects.filter(job=job)}
    assert steps["render"].worker == "w-A"  # recorded while A held the job
    assert steps["expensive"].worker == "w-B"  # A's late output was refused
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED and job.version == seen["version_after_b"]
    assert job.lease_owner == "w-B" or job.lease_owner == ""
    assert Artifact.objects.filter(job=job).count() == 1
    assert Effect.objects.filter(job=job).count() == 1


def test_step__a_stale_workers_output_is_refused_while_the_new_owner_works(make_user, monkeypatch):
    """B has claimed and not reached the step yet when A, whose lease ran out, finishes
    the step's fn: A's output is not recorded (the fence, not the unique row, refuses it)."""
    monkeypatch.setattr(steps_module, "RIDE_SECONDS", 0.0)  # step 1 recorded at its end
    user = make_user()
    job = _job(user, "fence")
    seen = {}

    def claimed_by_b(ctx_a):
        expire_lease(Job.objects.get(pk=ctx_a.job.pk))
        seen["b"] = claim_for(ctx_a.job.pk, "w-B")

    INSIDE["fence"] = claimed_by_b
    a = run_delivery(job.pk, worker="w-A")
    assert seen["b"].won
    assert a.outcome == Attempt.Outcome.LEASE_LOST
    assert list(JobStep.objects.filter(job=job).values_list("name", flat=True)) == ["render"]
    job.refresh_from_db()
    assert (job.state, job.lease_owner) == (Job.State.RUNNING, "w-B")
    assert not Artifact.objects.filter(job=job).exists()


def test_step__a_cancel_during_a_step_records_nothing_and_ends_cancelled(make_user):
    user = make_user()
    job = _job(user, "cancel")
    INSIDE["cancel"] = lambda ctx: jobs.cancel(ctx.job.pk, actor="test")
    result = run_delivery(job.pk, worker="w-1")
    assert result.outcome == Attempt.Outcome.CANCELLED
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED
    # "render" was waiting for the next fenced write, which never came: nothing recorded.
    assert not JobStep.objects.filter(job=job).exists()
    assert not Artifact.objects.filter(job=job).exists()
    assert not Effect.objects.filter(job=job).exists()


@pytest.mark.parametrize("bad", ["object", "nan", "too_big"])
def test_step__an_output_that_cannot_be_stored_fails_once_naming_the_step(bad):
    job, _ = request_job(
        "test.bad_step_output", subject_type="test", subject_id=bad, params={"bad": bad}
    )
    assert run_delivery(job.pk, worker="w-1").outcome == Attempt.Outcome.FAILED
    job.refresh_from_db()
    assert job.state == Job.State.FAILED and job.attempts == 1
    assert "ctx.step 'render'" in job.last_error_detail
    assert "xxxx" not in job.last_error_detail
    assert not JobStep.objects.filter(job=job).exists()


def test_step__fn_may_run_again_when_the_attempt_dies_before_the_record(make_user):
    """The uncooperative case: the worker dies (a signal, SIGKILL) after step 2's fn
    returned and before its record. Both quick steps were waiting for the next fenced
    write (``steps.RIDE_SECONDS``), so the next attempt runs both fns again, with the same
    step keys: "fn may run more than once; the record is once"."""
    user = make_user()
    job = _job(user, "crash")

    def die_after_fn(stage, ctx):
        if stage == "step_done:expensive" and ctx.job.attempts == 1:
            raise Crash(stage)

    with pytest.raises(Crash):
        run_delivery(job.pk, worker="w-1", on_stage=die_after_fn)
    assert not JobStep.objects.filter(job=job).exists()
    expire_lease(Job.objects.get(pk=job.pk))
    assert run_delivery(job.pk, worker="w-2").outcome == Attempt.Outcome.SUCCEEDED
    assert RUNS["crash", "render"] == 2
    assert RUNS["crash", "expensive"] == 2, "the fn ran again: its first output was never recorded"
    assert sorted(JobStep.objects.filter(job=job).values_list("name", flat=True)) == [
        "expensive",
        "render",
    ]


def test_step__work_over_a_second_is_recorded_at_the_step_and_survives_a_crash(
    make_user, monkeypatch
):
    """A step whose work (since the first unrecorded step began) reached ``RIDE_SECONDS``
    is recorded at its end by a fenced write of its own: a crash in the next step redoes
    only that step (the ride is made 0 s here, as if render had taken a second)."""
    from jobs.delivery import steps

    monkeypatch.setattr(steps, "RIDE_SECONDS", 0.0)
    user = make_user()
    job = _job(user, "slow_crash")

    def die_after_fn(stage, ctx):
        if stage == "step_done:expensive" and ctx.job.attempts == 1:
            raise Crash(stage)

    with pytest.raises(Crash):
        run_delivery(job.pk, worker="w-1", on_stage=die_after_fn)
    assert list(JobStep.objects.filter(job=job).values_list("name", flat=True)) == ["render"]
    expire_lease(Job.objects.get(pk=job.pk))
    assert run_delivery(job.pk, worker="w-2").outcome == Attempt.Outcome.SUCCEEDED
    assert (RUNS["slow_crash", "render"], RUNS["slow_crash", "expensive"]) == (1, 2)


def test_step__no_step_starts_past_the_kinds_timeout(make_user):
    """Step 1 ends after the kind's deadline (the test moves it): step 2's fn never runs,
    the attempt ends as a timeout, and the retry reuses step 1 and runs step 2 once."""
    user = make_user()
    job, _ = request_job(
        "test.two_steps_timed",
        subject_type="test",
        subject_id="timeout",
        params={"user": user.pk},
    )

    def deadline_passes(stage, ctx):
        if stage == "step_done:render":
            ctx._deadline = -1.0  # the kind's timeout ran out during step 1's fn

    first = run_delivery(job.pk, worker="w-1", on_stage=deadline_passes)
    assert first.outcome not in (Attempt.Outcome.SUCCEEDED, Attempt.Outcome.LEASE_LOST)
    assert RUNS["timeout", "render"] == 1 and RUNS["timeout", "expensive"] == 0
    assert list(JobStep.objects.filter(job=job).values_list("name", flat=True)) == ["render"]
    job.refresh_from_db()
    assert "timeout" in job.last_error_detail
    assert not Artifact.objects.filter(job=job).exists()
    make_due(job)
    assert run_delivery(job.pk, worker="w-2").outcome == Attempt.Outcome.SUCCEEDED
    assert (RUNS["timeout", "render"], RUNS["timeout", "expensive"]) == (1, 1)


def test_step__the_first_attempt_gets_the_value_a_later_attempt_reads_back():
    """A tuple or an int key does not survive JSON: the attempt that ran the fn gets the
    stored form too, so code after the step sees one value on every attempt."""
    job, _ = request_job(
        "test.step_json_shapes", subject_type="test", subject_id="shapes", params={}
    )
    assert run_delivery(job.pk, worker="w-1").outcome == Attempt.Outcome.RETRY
    make_due(Job.objects.get(pk=job.pk))
    assert run_delivery(job.pk, worker="w-2").outcome == Attempt.Outcome.SUCCEEDED
    assert SEEN["shapes", 1] == SEEN["shapes", 2] == {"1": [2, 3], "page": 4}


def test_step__a_database_error_in_the_record_is_a_retry_not_a_lost_lease(make_user, monkeypatch):
    """The record's transaction fails after its swap (the database went away mid-insert):
    both are rolled back, the attempt is recorded as a temporary failure against the
    version the row still has, and step 2's output, kept, is recorded by the retry's own
    fenced arrow: the retry reuses both steps."""
    from django.db import OperationalError

    from jobs.delivery import steps

    monkeypatch.setattr(steps, "RIDE_SECONDS", 0.0)  # each step recorded at its end
    user = make_user()
    job = _job(user, "db_error")
    real = steps.write
    failures = ["expensive"]

    def flaky(rows):
        if any(row.name in failures for row in rows):
            failures.clear()
            raise OperationalError("server closed the connection unexpectedly")
        return real(rows)

    monkeypatch.setattr(steps, "write", flaky)
    first = run_delivery(job.pk, worker="w-1")
    assert first.outcome == Attempt.Outcome.RETRY, first.outcome
    job.refresh_from_db()
    assert job.state == Job.State.RETRY_WAIT and job.last_error_class == "temporary"
    assert sorted(JobStep.objects.filter(job=job).values_list("name", flat=True)) == [
        "expensive",
        "render",
    ]
    make_due(job)
    assert run_delivery(job.pk, worker="w-2").outcome == Attempt.Outcome.SUCCEEDED
    assert (RUNS["db_error", "render"], RUNS["db_error", "expensive"]) == (1, 1)
