"""Bounded waits on PostgreSQL: a frozen worker's transaction is ended by the server.

Real connections in threads. Worker A freezes inside its publish transaction
(it sends nothing, as under SIGSTOP) past its lease; the server ends its
transaction, so A's commit fails; worker B reclaims and publishes; the
claim passes over rows that a transaction holds instead of waiting.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections, transaction
from django.db.models.functions import Now
from django_q.models import OrmQ

from jobs import claiming, conf, registry
from jobs.delivery.runner import run_delivery
from jobs.models import Attempt, Effect, Job, Notice
from jobs.providers.inapp import InAppProvider
from tests.jobs.helpers import expire_lease, request_job

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


class FreezingInApp(InAppProvider):
    """The in-app provider, but the first apply stops dead until released."""

    name = "test.freezing"

    def __init__(self):
        self.frozen = threading.Event()
        self.thaw = threading.Event()

    def apply(self, effect):
        if not self.frozen.is_set():
            self.frozen.set()
            self.thaw.wait(30)  # no statement is sent meanwhile: idle in transaction
        return super().apply(effect)


def test_worker_frozen_inside_publish__its_commit_fails_and_another_publishes(make_user):
    provider = registry.register_provider(FreezingInApp())
    user = make_user()
    job, _ = request_job(
        "test.notify_only",
        subject_type="auth.user",
        subject_id=user.pk,
        params={"recipient": user.pk, "providers": ["test.freezing"]},
    )
    outcome: dict = {}

    def worker_a():
        try:
            outcome["a"] = run_delivery(job.pk, worker="worker-a").outcome
        except Exception as exc:  # the server ended its transaction
            outcome["a"] = exc
        finally:
            connections.close_all()

    a = threading.Thread(target=worker_a)
    a.start()
    assert provider.frozen.wait(30), "worker A reached its publish"
    # Frozen past its lease (2 s): by then the server has ended A's transaction (0.5 s idle).
    assert _wait(lambda: _lease_over(job)), "A's lease ran out"
    assert _wait(lambda: not _job_row_locked(job)), "the server released A's row lock"
    result_b = run_delivery(job.pk, worker="worker-b")
    assert result_b.outcome == "succeeded"
    provider.thaw.set()  # A wakes up and tries to finish its publish
    a.join(30)
    assert isinstance(outcome["a"], Exception), f"A's commit must fail, got {outcome['a']!r}"
    assert (
        "idle" in str(outcome["a"])
        or "terminat" in str(outcome["a"])
        or "closed" in str(outcome["a"])
    )
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED
    assert Effect.objects.filter(job=job).count() == 1 and Notice.objects.count() == 1
    winner = Attempt.objects.get(job=job, outcome=Attempt.Outcome.SUCCEEDED)
    assert winner.worker == "worker-b"


def test_claim__passes_over_an_expired_lease_whose_row_is_locked_instead_of_waiting(make_user):
    """The claim of a queue's next due work (here a lease that ran out: its own verdict,
    ``decide_own_verdict``) skips a row another transaction holds, and takes it once that
    transaction ended; nothing is sent to ``django_q_ormq`` either way."""
    user = make_user()
    job, _ = request_job("test.steps", subject_type="auth.user", subject_id=user.pk)
    run_delivery(job.pk, worker="w1")  # succeeded; make another one that looks stuck
    stuck, _ = request_job("test.steps", subject_type="auth.user", subject_id=user.pk + 1000)
    Job.objects.filter(pk=stuck.pk).update(
        state=Job.State.RUNNING, lease_owner="gone", lease_expires_at=Now()
    )
    expire_lease(stuck)
    holding, release = threading.Event(), threading.Event()

    def holder():
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(pk=stuck.pk)
                holding.set()
                release.wait(30)
        finally:
            connections.close_all()

    claims = claiming.claims()
    lease, bound = conf.lease_seconds(), conf.tenant_concurrency()
    t = threading.Thread(target=holder)
    t.start()
    try:
        assert holding.wait(10)
        # Would block on the row lock without SKIP LOCKED.
        assert claims.decide_own_verdict("default", "w2", lease=lease, bound=bound) is None
        assert claims.claim_next("default", "w2", lease=lease, bound=bound) is None
        assert not release.is_set()
        assert Job.objects.get(pk=stuck.pk).lease_owner == "gone", "passed over this look"
    finally:
        release.set()
        t.join(30)
    again = claims.decide_own_verdict("default", "w2", lease=lease, bound=bound)
    assert again is not None and again.status == "claimed" and again.job.pk == stuck.pk
    assert Job.objects.get(pk=stuck.pk).lease_owner == "w2", "and taken by the next look"
    assert not OrmQ.objects.exists()


def _lease_over(job: Job) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT lease_expires_at < now() FROM jobs_job WHERE id = %s", [job.pk])
        return cursor.fetchone()[0]


def _job_row_locked(job: Job) -> bool:
    with transaction.atomic():
        return (
            not Job.objects.select_for_update(nowait=False, skip_locked=True)
            .filter(pk=job.pk)
            .exists()
        )


def _wait(check, timeout: float = 15.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False
