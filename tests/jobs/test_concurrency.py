"""Races on PostgreSQL with real threads, each on its own connection."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from jobs import artifacts, rules
from jobs.delivery import runner
from jobs.delivery.runner import run_delivery
from jobs.models import Artifact, Attempt, Effect, Job, Notice
from tests.jobs.helpers import expire_lease, new_job, request_job

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def in_threads(n: int, fn):
    """Run fn(i) in n threads released together by a barrier; close their connections."""
    barrier = threading.Barrier(n)

    def run(i):
        try:
            barrier.wait()
            return fn(i)
        finally:
            connection.close()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def test_claim__n_concurrent_claimers_exactly_one_wins(make_user):
    user = make_user()
    for round_ in range(5):
        job = new_job(user, revision=round_ + 1, tenant=f"office-{round_}")
        claims = in_threads(8, lambda i, pk=job.pk: runner.claim_for(pk, f"w{i}").status)
        assert claims.count("claimed") == 1, claims
        # A loser waits for the winner's claim lock, then reads the job started: each is
        # recorded as the duplicate delivery it is (``named_claim.claim``).
        assert claims.count("duplicate") == 7, claims
        job.refresh_from_db()
        assert job.attempts == 1 and job.version == 1
        assert Attempt.objects.filter(job=job, outcome="duplicate_delivery").count() == 7


def test_request_job__concurrent_requests_get_the_same_job(make_user):
    user = make_user()

    def ask(i):
        job, _ = request_job(
            "test.steps", subject_type="auth.user", subject_id=user.pk, output_revision=3
        )
        return job.pk

    ids = in_threads(6, ask)
    assert len(set(ids)) == 1 and Job.objects.count() == 1


def test_paused_worker__loses_lease_second_publishes_first_publishes_nothing(make_user):
    user = make_user()
    job = new_job(user)
    stored, resume = threading.Event(), threading.Event()
    result = {}

    def pause_after_artifact(stage, ctx):
        if stage == "artifact_stored":
            result["name"] = ctx.artifact.storage_name
            stored.set()
            assert resume.wait(30)

    def first():
        try:
            result["first"] = run_delivery(job.pk, worker="first", on_stage=pause_after_artifact)
        finally:
            connection.close()

    thread = threading.Thread(target=first)
    thread.start()
    assert stored.wait(30)
    assert not Artifact.objects.filter(job=job).exists(), "the row commits with the publish"
    path = artifacts.get_storage().path(result["name"])
    first_file = os.stat(path).st_ino
    expire_lease(job)  # time travel: the first lease runs out while the first worker waits

    second = run_delivery(job.pk, worker="second")
    assert second.outcome == "succeeded"
    resume.set()
    thread.join(30)
    assert result["first"].outcome == "lease_lost"

    (artifact,) = Artifact.objects.filter(job=job)
    assert artifact.storage_name == result["name"], "same bytes, same name: reused"
    assert artifact.rewrites == 0 and os.stat(path).st_ino == first_file, "verified, not rewritten"
    assert Effect.objects.filter(job=job).count() == 1
    assert Notice.objects.filter(recipient=user).count() == 1
    by_worker = dict(Attempt.objects.filter(job=job).values_list("worker", "outcome"))
    assert by_worker == {"first": "lease_lost", "second": "succeeded"}
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED and job.lease_owner == "second"


def test_tenant_bound__holds_under_concurrent_claimers(make_user, settings):
    settings.JOBS_TENANT_CONCURRENCY = 2
    user = make_user()
    jobs = [new_job(user, subject=i, tenant="busy-office") for i in range(8)]
    other = new_job(user, subject=99, tenant="quiet-office")

    statuses = in_threads(8, lambda i: runner.claim_for(jobs[i].pk, f"w{i}").status)
    assert statuses.count("claimed") == 2, statuses
    # The rest deferred by the bound, or passed: their row was held by another claim's
    # statement as a candidate, and a claim never waits for a row (rows before scopes).
    assert set(statuses) - {"claimed"} <= {"deferred", "passed"}, statuses
    assert Job.objects.filter(rules.to_q(rules.LIVE_RUNNING), tenant_key="busy-office").count() == 2
    assert Job.objects.filter(tenant_key="busy-office", attempts=0).count() == 6
    assert runner.claim_for(other.pk, "w-other").status == "claimed", "bounds are per tenant"


def test_publish__job_row_locked_elsewhere__no_wait_then_the_orm_transaction_publishes(
    make_user, caplog
):
    """The one-statement publish does not queue behind another transaction's lock on the
    job (it has no lock timeout of its own); the ORM publish, which has one, waits."""
    user = make_user()
    job = new_job(user)
    locked, release = threading.Event(), threading.Event()

    def hold_row_lock():
        from django.db import transaction

        try:
            with transaction.atomic():
                list(Job.objects.select_for_update().filter(pk=job.pk))
                locked.set()
                release.wait(30)
        finally:
            connection.close()

    def lock_then_release(stage, ctx):
        if stage == "before_publish":
            holder.start()
            assert locked.wait(30)
            threading.Timer(0.5, release.set).start()

    holder = threading.Thread(target=hold_row_lock)
    with caplog.at_level("INFO", logger="jobs.publish"):
        result = run_delivery(job.pk, worker="w1", on_stage=lock_then_release)
    holder.join(30)
    assert result.outcome == "succeeded"
    assert "one-statement publish gave way (lock_not_available)" in caplog.text
    assert Effect.objects.get(job=job).state == Effect.State.APPLIED
    assert Notice.objects.filter(recipient=user).count() == 1
    assert Artifact.objects.filter(job=job).count() == 1


def test_claim__busy_tenant_lock__waits_at_most_the_lock_timeout_then_defers(make_user, settings):
    """Another transaction holds the tenant's lock for 20 s: the one-statement claim does
    not wait at all, the ORM claim waits its lock timeout (1 s here) and defers the job
    without spending an attempt."""
    from jobs import rules

    settings.JOBS_LOCK_TIMEOUT_SECONDS = 1
    job = new_job(make_user(), tenant="busy-office")
    held, release = threading.Event(), threading.Event()

    def hold():
        try:
            with connection.cursor() as cursor:
                cursor.execute("BEGIN")
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
                    [rules.TENANT_LOCK_CLASS, "busy-office"],
                )
                held.set()
                release.wait(20)
                cursor.execute("ROLLBACK")
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        started = time.monotonic()
        claim = runner.claim_for(job.pk, "w1")
        waited = time.monotonic() - started
    finally:
        release.set()
        holder.join(20)
    assert claim.status == "deferred"
    assert waited < 10, f"the claim waited {waited:.1f} s behind a lock held for 20 s"
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED and job.attempts == 0
    assert job.next_attempt_at is not None
