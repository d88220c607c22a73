"""Per-kind timeouts: a handler past its kind's ``timeout`` is stopped, cooperatively at its
next check or, a grace period later, by the worker's hard stop (SIGALRM in the main
thread); the attempt is a transient ``timeout``, retried within the budget, and the next
attempt reuses the artifact file the stopped one stored."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from django.db import connection

from jobs import artifacts, checks
from jobs.delivery.runner import run_delivery
from jobs.exceptions import JobTimeout
from jobs.models import Artifact, Attempt, Effect, Job
from jobs.registry import EffectSpec, kinds, register_kind
from tests.jobs.helpers import make_due, request_job

SLEEPER = "test.timeout.sleeper"
CHECKER = "test.timeout.checker"
SWALLOWER = "test.timeout.swallower"
SEEN: dict[str, object] = {}


def _sleeper(ctx):
    """Stores its artifact, then (on the attempts ``params.slow`` names) sleeps without a
    check: only the hard stop can end that attempt."""
    ctx.check_owner()
    ctx.store_artifact(b"timeout report\n", content_type="text/plain", extension="txt")
    if ctx.job.attempts in ctx.params.get("slow", []):
        time.sleep(float(ctx.params.get("sleep", 10)))
    return [EffectSpec("done", "inapp", str(ctx.params["user"]), {"title": "Done"})]


def _checker(ctx):
    """Heartbeats between short steps: stopped cooperatively at the first check past it."""
    while True:
        try:
            ctx.heartbeat()
        except JobTimeout:
            SEEN["cooperative"] = True
            raise
        time.sleep(0.02)


def _swallower(ctx):
    """Catches the hard stop and returns as if it finished: it still publishes nothing."""
    try:
        time.sleep(10)
    except JobTimeout:
        SEEN["swallowed"] = True
    return [EffectSpec("done", "inapp", str(ctx.params["user"]), {"title": "Done"})]


for _name, _handler, _timeout in (
    (SLEEPER, _sleeper, 2),
    (CHECKER, _checker, 0.3),
    (SWALLOWER, _swallower, 0.3),
):
    if _name not in kinds():
        register_kind(_name, _handler, timeout=_timeout)


@pytest.fixture
def roomy(settings):
    """A lease that outlasts the stopped attempt (the 2 s test lease would expire in it)."""
    settings.JOBS_LEASE_SECONDS = 60
    settings.JOBS_TIMEOUT_GRACE_SECONDS = 1.0
    return settings


def _job(kind: str, subject: int, **params) -> Job:
    job, _ = request_job(kind, subject_type="test", subject_id=subject, params=params)
    return job


@pytest.mark.django_db(transaction=True)
def test_timeout__a_handler_that_sleeps_is_stopped_retried_and_succeeds_once(
    roomy, make_user, monkeypatch
):
    stored: list[tuple[str, bool]] = []
    real_store = artifacts.store

    def spy(*args, **kwargs):
        result = real_store(*args, **kwargs)
        stored.append((result.artifact.storage_name, result.reused))
        return result

    monkeypatch.setattr(artifacts, "store", spy)
    user = make_user()
    job = _job(SLEEPER, 1, user=user.pk, slow=[1], sleep=10)

    began = time.monotonic()
    first = run_delivery(job.pk, worker="w-timeout")
    took = time.monotonic() - began
    print(f"\nthe 10 s sleep was stopped after {took:.2f} s (timeout 2 s, grace 1 s)")
    assert first.outcome == Attempt.Outcome.RETRY, first
    assert took < 9, "the sleep ran to its end: nothing stopped it"
    job.refresh_from_db()
    assert (job.state, job.last_error_class, job.last_error_code) == (
        Job.State.RETRY_WAIT,
        "temporary",
        "timeout",
    )
    (attempt,) = Attempt.objects.filter(job=job)
    assert (attempt.outcome, attempt.error_code) == (Attempt.Outcome.RETRY, "timeout")
    assert not Artifact.objects.filter(job=job).exists()

    make_due(job)
    second = run_delivery(job.pk, worker="w-timeout")
    assert second.outcome == Attempt.Outcome.SUCCEEDED, second
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED and job.attempts == 2
    (artifact,) = Artifact.objects.filter(job=job)
    assert Effect.objects.filter(job=job).count() == 1, "one effect: the job succeeded once"
    # Both attempts asked for the same file; the second found the first one's and reused it.
    assert [name for name, _ in stored] == [artifact.storage_name] * 2
    assert [reused for _, reused in stored] == [False, True]


@pytest.mark.django_db(transaction=True)
def test_timeout__a_handler_that_checks_is_stopped_at_its_next_check(roomy, make_user):
    roomy.JOBS_TIMEOUT_GRACE_SECONDS = 60  # the hard stop cannot be what ends it
    SEEN.clear()
    job = _job(CHECKER, 2)
    result = run_delivery(job.pk, worker="w-timeout")
    assert result.outcome == Attempt.Outcome.RETRY, result
    assert SEEN.get("cooperative") is True
    job.refresh_from_db()
    assert job.last_error_code == "timeout"


@pytest.mark.django_db(transaction=True)
def test_timeout__a_handler_that_swallows_the_stop_publishes_nothing(roomy, make_user):
    """And django-q2's own alarm (the same SIGALRM timer) is armed again afterwards."""
    roomy.JOBS_TIMEOUT_GRACE_SECONDS = 0.3
    SEEN.clear()
    outer = signal.signal(signal.SIGALRM, lambda *a: None)
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        job = _job(SWALLOWER, 3, user=make_user().pk)
        result = run_delivery(job.pk, worker="w-timeout")
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        handler = signal.getsignal(signal.SIGALRM)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer)
    assert SEEN.get("swallowed") is True
    assert result.outcome == Attempt.Outcome.RETRY, result
    assert not Effect.objects.filter(job=job).exists()
    assert 20 < left < 30, left
    assert handler is not outer and handler is not signal.SIG_DFL


@pytest.mark.django_db(transaction=True)
def test_timeout__outside_the_main_thread_the_stop_is_cooperative_only(roomy, make_user):
    """No signal reaches another thread: the handler runs on and is stopped at its check."""
    SEEN.clear()
    job = _job(CHECKER, 4)
    out: dict = {}

    def target():
        try:
            out["result"] = run_delivery(job.pk, worker="w-thread")
        finally:
            connection.close()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    assert out["result"].outcome == Attempt.Outcome.RETRY
    assert SEEN.get("cooperative") is True


def test_check_kind_timeouts__below_q_timeout_and_heartbeats_past_the_lease(settings):
    settings.Q_CLUSTER = {"orm": "default", "timeout": 5, "retry": 7}
    settings.JOBS_LEASE_SECONDS = 1
    by_kind = {m.msg.split("'")[1]: m for m in checks.check_kind_timeouts()}
    assert by_kind[SLEEPER].id == "jobs.W018"  # 2 s > the 1 s lease: heartbeats needed
    assert "JOBS_LEASE_SECONDS" in by_kind[SLEEPER].msg
    assert CHECKER not in by_kind
    settings.Q_CLUSTER = {"orm": "default", "timeout": 2, "retry": 7}
    settings.JOBS_LEASE_SECONDS = 1
    error = next(m for m in checks.check_kind_timeouts() if SLEEPER in m.msg)
    assert error.id == "jobs.E007"
    assert "Q_CLUSTER['timeout']" in error.msg and "timeout (2 s)" in error.msg
