"""Cancelling a running job: the handler stops at its next check, or, if it never looks,
its publish is refused (the request moved the version the publish is fenced on); either
way the job ends ``cancelled`` with no artifact row, no effect and no notice. A cancel
after the publish committed answers "already finished" and changes nothing."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

import jobs
from jobs import executors
from jobs.delivery.runner import run_delivery
from jobs.models import Artifact, Attempt, Effect, Job, JobEvent, Notice
from jobs.registry import EffectSpec, kinds, register_kind
from tests.jobs.helpers import request_job

KIND = "test.cancellable"
GATES: dict[int, tuple[threading.Event, threading.Event]] = {}


def _handler(ctx):
    """Waits inside its work on the test's event; checks the fence only if asked to."""
    started, proceed = GATES[int(ctx.job.subject_id)]
    started.set()
    assert proceed.wait(20), "the test never let the handler go on"
    if ctx.params.get("checks"):
        ctx.check_owner()
        ctx.store_artifact(b"report\n", content_type="text/plain", extension="txt")
    return [EffectSpec("done", "inapp", str(ctx.params["user"]), {"title": "Done"})]


if KIND not in kinds():
    register_kind(KIND, _handler)


def _job(user, subject: int, *, checks: bool) -> Job:
    GATES[subject] = (threading.Event(), threading.Event())
    job, _ = request_job(
        KIND,
        subject_type="test",
        subject_id=subject,
        params={"user": user.pk, "checks": checks},
    )
    return job


def _run_in_thread(job_id: int) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def target():
        try:
            out["result"] = run_delivery(job_id, worker="w-cancel")
        finally:
            connection.close()

    thread = threading.Thread(target=target)
    thread.start()
    return thread, out


def _nothing_published(job: Job) -> None:
    assert not Artifact.objects.filter(job=job).exists()
    assert not Effect.objects.filter(job=job).exists()
    assert not Notice.objects.filter(effect__job=job).exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("executor", ["postgres", "orm"])
@pytest.mark.parametrize("checks", [True, False], ids=["handler checks", "handler never checks"])
def test_cancel__while_the_handler_runs__ends_cancelled_and_publishes_nothing(
    make_user, monkeypatch, executor, checks
):
    monkeypatch.setattr(executors, "current", lambda: executors.by_name(executor))
    user = make_user()
    job = _job(user, 1 if checks else 2, checks=checks)
    started, proceed = GATES[int(job.subject_id)]
    thread, out = _run_in_thread(job.pk)
    assert started.wait(20), "the handler never started"
    assert jobs.cancel(job.pk, actor="operator:ana") == "requested"
    proceed.set()
    thread.join(30)
    assert out["result"].outcome == "cancelled", out
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED and job.last_error_code == "cancelled"
    _nothing_published(job)
    (attempt,) = Attempt.objects.filter(job=job)
    assert attempt.outcome == Attempt.Outcome.CANCELLED
    (event,) = JobEvent.objects.filter(job=job)
    assert (event.action, event.actor, event.from_state) == (
        "cancel_requested",
        "operator:ana",
        "running",
    )
    assert jobs.cancel(job.pk) == "already_finished"


@pytest.mark.django_db(transaction=True)
def test_cancel__after_the_publish__already_finished_and_nothing_changes(make_user):
    user = make_user()
    job = _job(user, 3, checks=True)
    GATES[3][1].set()
    assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    job.refresh_from_db()
    version = job.version
    assert jobs.cancel(job.pk, actor="operator:ana") == "already_finished"
    job.refresh_from_db()
    assert (job.state, job.version) == (Job.State.SUCCEEDED, version)
    assert not JobEvent.objects.filter(job=job).exists()
    assert Notice.objects.filter(effect__job=job).count() == 1, "applied effects stay"


@pytest.mark.django_db(transaction=True)
def test_cancel__a_waiting_job__cancelled_at_once(make_user):
    job = _job(make_user(), 4, checks=True)
    handle = jobs.request(KIND, ("test", 4), params={"user": job.params["user"], "checks": True})
    assert handle.cancel(actor="operator:ana") == "cancelled"
    assert handle.state == Job.State.CANCELLED
    assert run_delivery(job.pk, worker="w1").outcome == "duplicate"
    assert jobs.cancel(10**9) == "missing"


@pytest.mark.django_db(transaction=True)
def test_cancel__its_worker_gone__the_next_claim_ends_it_without_running_it(make_user):
    """A cancel asked for a running job whose worker then died: when the lease runs out,
    the redelivery ends the job cancelled instead of running the handler again."""
    job = _job(make_user(), 5, checks=True)
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.RUNNING,
        attempts=1,
        lease_owner="dead-worker",
        lease_expires_at=timezone.now() + timedelta(seconds=60),
    )
    Attempt.objects.create(job=job, number=1, worker="dead-worker")
    assert jobs.cancel(job.pk, actor="operator:ana") == "requested"
    Job.objects.filter(pk=job.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert run_delivery(job.pk, worker="w2").outcome == "cancelled"
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED
    assert not GATES[5][0].is_set(), "the handler did not run again"
    outcomes = sorted(Attempt.objects.filter(job=job).values_list("outcome", flat=True))
    assert outcomes == ["cancelled", "cancelled"]
    _nothing_published(job)
