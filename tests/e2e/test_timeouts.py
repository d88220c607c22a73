"""A kind's timeout under a real ``qcluster``: the worker's hard stop ends a handler that
sleeps past it (it never checks), the attempt is a transient ``timeout``, and the retry,
fast this time, succeeds once."""

from __future__ import annotations

import time

import pytest
from django.contrib.auth.models import User

from jobs.models import Artifact, Attempt, Effect, Job
from jobs.registry import EffectSpec, kinds, register_kind
from tests.e2e.processes import wait_until
from tests.jobs.helpers import request_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

KIND = "test.e2e.timeout"
TIMEOUT, GRACE = 2, 1.0

# The qcluster this test starts: the kind registered before the cluster forks its workers,
# a 1 s grace, and django-q2's timeout (20 s) and retry (30 s) with a 15 s lease, so the
# hard stop (3 s) and not the lease or django-q2 is what ends the slow attempt. Run by
# ``manage.py shell -c``: call_command runs no system checks, the settings stay as set.
CLUSTER = f"""
from django.conf import settings
from django.core.management import call_command
from django_q.conf import Conf
from tests.e2e.test_timeouts import register
register()
settings.JOBS_TIMEOUT_GRACE_SECONDS = {GRACE}
settings.JOBS_LEASE_SECONDS = 15
settings.Q_CLUSTER = {{**settings.Q_CLUSTER, "timeout": 20, "retry": 30}}
Conf.TIMEOUT, Conf.RETRY = 20, 30
call_command("qcluster")
"""


def slow_then_fast(ctx) -> list[EffectSpec]:
    """Sleeps 10 s without a check on its first attempt; the next one is quick."""
    ctx.check_owner()
    ctx.store_artifact(b"e2e timeout\n", content_type="text/plain", extension="txt")
    if ctx.job.attempts == 1:
        time.sleep(10)
    return [EffectSpec("done", "inapp", str(ctx.params["user"]), {"title": "Done"})]


def register() -> None:
    if KIND not in kinds():
        register_kind(KIND, slow_then_fast, timeout=TIMEOUT)


register()


def test_timeout__a_real_worker_stops_a_sleeping_handler_and_the_retry_succeeds_once(procs):
    user = User.objects.create_user(username="e2e-timeout")
    job, _ = request_job(KIND, subject_type="test", subject_id=1, params={"user": user.pk})
    procs.start("qcluster", "shell", "-c", CLUSTER)
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.2")

    wait_until(
        procs,
        "the job to succeed",
        lambda: Job.objects.filter(pk=job.pk, state__in=Job.TERMINAL).exists(),
        timeout=60,
    )
    job.refresh_from_db()
    assert job.attempts == 2, "one attempt: the sleep ran to its end, nothing stopped it"
    first, second = Attempt.objects.filter(job=job, number__gt=0).order_by("number")
    took = (first.finished_at - first.started_at).total_seconds()
    print(f"\nreal qcluster: the 10 s sleep stopped after {took:.2f} s (timeout 2 s, grace 1 s)")
    assert job.state == Job.State.SUCCEEDED and job.attempts == 2
    assert (first.outcome, first.error_class, first.error_code) == ("retry", "temporary", "timeout")
    assert took < 9, "the sleep ran to its end: nothing stopped it"
    assert second.outcome == Attempt.Outcome.SUCCEEDED
    assert first.worker == second.worker, "the stop left the worker process alive"
    assert Artifact.objects.filter(job=job).count() == 1
    assert Effect.objects.filter(job=job).count() == 1
