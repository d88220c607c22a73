"""``ctx.read``: a handler's private read that is also its ownership check.

The read's rows come back only while the worker still holds the job (one statement:
``SELECT ... WHERE ... AND EXISTS (the job, this worker, this version, a live lease)``),
so a worker that lost the job between its claim and its read reads nothing at all, and a
held job's read costs no round trip for the check.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext

import jobs
from jobs.delivery.runner import claim_for, run_delivery
from jobs.exceptions import PayloadInvalid
from jobs.models import Artifact, Attempt, Job, Notice
from jobs.registry import EffectSpec, kinds, register_kind
from tests.jobs.helpers import expire_lease, request_job

pytestmark = pytest.mark.django_db(transaction=True)

KIND = "test.fenced-read"
SEEN: dict[int, dict] = {}  # per job: what the handler read, and the statements it sent


def _handler(ctx):
    seen = SEEN.setdefault(ctx.job.pk, {})
    with CaptureQueriesContext(connection) as captured:
        users = ctx.read(get_user_model().objects.filter(pk=ctx.params["user"]))
    seen["users"], seen["sql"] = users, [q["sql"] for q in captured]
    if not users:
        raise PayloadInvalid("params.user names no user")
    ctx.store_artifact(b"summary\n", content_type="text/plain", extension="txt")
    return [EffectSpec("done", "inapp", str(users[0].pk), {"title": "Done"})]


if KIND not in kinds():
    register_kind(KIND, _handler)


def _job(user_pk: int, subject: int) -> Job:
    job, _ = request_job(KIND, subject_type="test", subject_id=subject, params={"user": user_pk})
    return job


def test_read__held__the_rows_and_the_check_in_one_statement(make_user):
    user = make_user()
    job = _job(user.pk, 1)

    result = run_delivery(job.pk)

    assert result.outcome == Attempt.Outcome.SUCCEEDED
    seen = SEEN[job.pk]
    assert [u.pk for u in seen["users"]] == [user.pk]
    assert len(seen["sql"]) == 1, seen["sql"]
    assert "EXISTS" in seen["sql"][0] and "jobs_job" in seen["sql"][0]
    assert Notice.objects.filter(effect__job=job, recipient=user).count() == 1


def test_read__reclaimed_before_the_read__reads_nothing_and_publishes_nothing(make_user):
    """Another worker took the job over (the first one's lease ran out) after the claim
    and before the read: the first worker's read returns no row, not even to look at."""
    user = make_user()
    job = _job(user.pk, 2)

    def taken_over(stage, ctx):
        if stage == "claimed":
            expire_lease(ctx.job)
            assert claim_for(ctx.job.pk, "w-second").won

    result = run_delivery(job.pk, worker="w-first", on_stage=taken_over)

    assert result.outcome == Attempt.Outcome.LEASE_LOST
    assert "users" not in SEEN.get(job.pk, {}), "the lost worker's read returned"
    job.refresh_from_db()
    assert (job.state, job.lease_owner) == (Job.State.RUNNING, "w-second")
    assert not Artifact.objects.filter(job=job).exists()
    assert not Notice.objects.filter(effect__job=job).exists()


def test_read__cancel_asked_before_the_read__the_job_ends_cancelled(make_user):
    user = make_user()
    job = _job(user.pk, 3)

    def cancelled(stage, ctx):
        if stage == "claimed":
            assert jobs.cancel(ctx.job.pk) != "already finished"

    result = run_delivery(job.pk, on_stage=cancelled)

    assert result.outcome == Attempt.Outcome.CANCELLED
    assert "users" not in SEEN.get(job.pk, {})
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED
    assert not Notice.objects.filter(effect__job=job).exists()


def test_read__no_such_row_while_held__an_empty_list_after_the_check(make_user):
    """No row is not a lost job: the check alone then tells them apart (one more
    statement, on this path only), and the kind's own error is the attempt's."""
    job = _job(987654, 4)

    result = run_delivery(job.pk)

    assert result.outcome == Attempt.Outcome.FAILED
    seen = SEEN[job.pk]
    assert seen["users"] == [] and len(seen["sql"]) == 2, seen["sql"]
    job.refresh_from_db()
    assert (job.state, job.last_error_code) == (Job.State.FAILED, "payload_invalid")
