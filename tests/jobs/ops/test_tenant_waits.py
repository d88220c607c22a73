"""Each tenant's wait (due → start) in the console: the claim records when a job was due,
on both executors; the console reads the window's starts per tenant (issue 42)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

import jobs
from jobs.models import Attempt, Job
from jobs.ops import tenantwait
from tests.jobs.helpers import claim_next, expire_lease, new_job, run_job

pytestmark = pytest.mark.django_db


def _close(a, b) -> bool:
    return abs((a - b).total_seconds()) < 0.001


def test_claim__the_attempt_keeps_when_its_job_was_due(make_user):
    """The next-job claim (the statement on PostgreSQL, the ORM claim on SQLite): a job
    asked to run after a time was due then, not when it was asked for."""
    user = make_user()
    due = timezone.now() - timedelta(minutes=3)
    handle = jobs.request(
        "test.steps", ("auth.user", user.pk), params={"recipients": [user.pk]}, run_after=due
    )
    claim = claim_next(worker="w1")
    assert claim is not None and claim.won and claim.job.pk == handle.job.pk
    attempt = Attempt.objects.get(job=handle.job)
    assert attempt.due_at is not None and _close(attempt.due_at, due)
    assert attempt.started_at - attempt.due_at >= timedelta(minutes=3)


def test_claim__a_job_asked_for_now_was_due_at_its_request(make_user):
    job = new_job(make_user())
    asked = Job.objects.get(pk=job.pk).next_attempt_at
    assert claim_next(worker="w1").won
    assert _close(Attempt.objects.get(job=job).due_at, asked)


def test_named_claim__a_reclaimed_job_was_due_when_its_lease_ran_out(make_user):
    """The engine's own claim (a delivery by name, the ORM's verdict), of a job whose
    worker died: due since its lease expired, not since it was first asked for."""
    job = new_job(make_user())
    assert claim_next(worker="w-dead").won
    expire_lease(job)
    expired = Job.objects.get(pk=job.pk).lease_expires_at
    run_job(job.pk, worker="w2")
    second = Attempt.objects.filter(job=job, number=2).get()
    assert _close(second.due_at, expired)


def _attempt(job: Job, *, started, waited: float | None, outcome="", number=1) -> None:
    due = None if waited is None else started - timedelta(seconds=waited)
    Attempt.objects.create(
        job=job, number=number, worker="w", started_at=started, due_at=due, outcome=outcome
    )


def _started(ids: list[int], now) -> None:
    """The jobs ran (they no longer wait)."""
    Job.objects.filter(pk__in=ids).update(state=Job.State.SUCCEEDED, finished_at=now)


def test_tenant_waits__median_and_95th_per_tenant_over_the_window(make_user):
    """The same figures on both databases (PostgreSQL's ``percentile_cont``, SQLite's in
    Python): starts outside the window, deferrals, duplicate deliveries and attempts from
    before the due time was kept are not starts."""
    user = make_user()
    now = timezone.now()
    a = [new_job(user, tenant="acme", subject=i) for i in range(20)]
    b = new_job(user, tenant="beta", subject=100)
    waiting = new_job(user, tenant="gamma", subject=200)
    for i, job in enumerate(a):  # waited 1, 2, ... 20 s
        _attempt(job, started=now - timedelta(seconds=30), waited=i + 1.0)
    _attempt(b, started=now - timedelta(seconds=10), waited=0.25)
    _attempt(b, started=now - timedelta(minutes=20), waited=900.0)  # before the window
    _attempt(b, started=now - timedelta(seconds=5), waited=500.0, outcome="deferred")
    _attempt(b, started=now - timedelta(seconds=5), waited=500.0, outcome="duplicate_delivery")
    _attempt(b, started=now - timedelta(seconds=5), waited=None)  # no due time kept
    _started([j.pk for j in a] + [b.pk], now)

    rows = {r.tenant: r for r in tenantwait.tenant_waits(timedelta(minutes=5), now=now)}
    assert set(rows) == {"acme", "beta", "gamma"}
    acme, beta, gamma = rows["acme"], rows["beta"], rows["gamma"]
    assert (acme.starts, acme.waiting) == (20, 0)
    assert acme.p50_seconds == pytest.approx(10.5) and acme.p95_seconds == pytest.approx(19.05)
    assert (beta.starts, beta.p50_seconds, beta.p95_seconds) == (1, 0.25, 0.25)
    assert (gamma.starts, gamma.p95_seconds, gamma.waiting) == (0, None, 1)
    assert waiting.state == Job.State.QUEUED


def test_percentile__interpolates_as_percentile_cont():
    assert tenantwait.percentile([], 0.95) is None
    assert tenantwait.percentile([4.0], 0.95) == 4.0
    assert tenantwait.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert tenantwait.percentile([10.0, 0.0], 0.95) == pytest.approx(9.5)


def test_console__shows_each_tenants_wait_and_who_waits_now(client, admin_user, make_user):
    user = make_user()
    now = timezone.now()
    job = new_job(user, tenant="acme", subject=1)
    new_job(user, tenant="beta", subject=2)
    _attempt(job, started=now - timedelta(seconds=20), waited=2.5)
    _started([job.pk], now)
    client.force_login(admin_user)
    for url in ("/admin/jobs/job/dashboard/", "/admin/jobs/job/dashboard/?part=live"):
        body = client.get(url).content.decode()
        assert 'id="tenant-waits"' in body
        acme = body.split('data-tenant="acme"')[1].split("</tr>")[0]
        assert "<td>1</td>" in acme and "2.5 s" in acme, acme
        beta = body.split('data-tenant="beta"')[1].split("</tr>")[0]
        assert "—" in beta and "<td>1</td>" in beta, beta
