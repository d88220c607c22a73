"""Workers whose clocks are 30 s wrong: no early reclaim, no send claimed again in flight.

Real processes with skewed clocks (``tests/e2e/skewed_clock/sitecustomize.py``): one
qcluster 30 s behind, one 30 s ahead, and the dispatcher 30 s ahead. Every claim compares
the rows' leases and due times with the database server's clock (``jobs.clock``; the
jobs table and the ledger are the queue, no message carries a process's clock), so none
of that may matter: a cluster ahead sees nothing expire early.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django_q.models import OrmQ

from jobs.models import Attempt, Effect, EffectEvent, Job
from tests.e2e.processes import PROVIDER_TOKEN, wait_until
from tests.jobs.helpers import request_job

SKEW_DIR = Path(__file__).parent / "skewed_clock"


def _skewed(env: dict, seconds: int) -> dict:
    path = os.pathsep.join(p for p in (str(SKEW_DIR), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "TEST_CLOCK_SKEW_SECONDS": str(seconds)}


def _clock_offset(env: dict) -> float:
    # Settings load first (tz.now() reads USE_TZ): on a busy machine importing them took
    # over a second between the two clock reads.
    code = (
        "import time, django.utils.timezone as tz; from django.conf import settings; "
        "settings.USE_TZ; print(time.time(), tz.now().timestamp())"
    )
    theirs = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    wall, django_now = (float(v) for v in theirs.stdout.split())
    now = time.time()
    assert abs((wall - now) - (django_now - now)) < 1
    return wall - now


@pytest.mark.drill
def test_workers_30s_behind_and_ahead__no_early_reclaim_and_no_send_claimed_again_in_flight(
    procs, provider
):
    provider.faults.delay = 1.0  # each send takes a second
    procs.env.update(
        NOTICE_PROVIDER_URL=provider.url,
        NOTICE_PROVIDER_TOKEN=PROVIDER_TOKEN,
        NOTICE_PROVIDER_CONNECT_TIMEOUT="0.5",
        NOTICE_PROVIDER_READ_TIMEOUT="2",
        JOBS_EFFECT_LEASE_SECONDS="5",
    )
    behind, ahead = _skewed(procs.env, -30), _skewed(procs.env, 30)
    assert _clock_offset(behind) < -29 and _clock_offset(ahead) > 29, "faketime is in effect"

    user = User.objects.create_user(username="e2e-skew")
    for n in range(6):  # longer than the 2 s lease: heartbeats keep it
        request_job(
            "test.steps",
            subject_type="auth.user",
            subject_id=n,
            tenant_key=f"t{n}",
            params={"recipients": [user.pk], "stages": 1, "after_stages": 5, "stage_sleep": 0.5},
        )
    for n in range(6):  # webhook sends that take 1 s, under a 5 s sending lease
        request_job(
            "test.notify_only",
            subject_type="auth.user",
            subject_id=100 + n,
            tenant_key=f"n{n}",
            params={"recipient": user.pk, "providers": ["webhook"]},
        )
    assert not OrmQ.objects.exists(), "the rows are the queue: no message carries a clock"
    base = procs.env
    try:
        procs.env = behind
        late = procs.start("qcluster-behind", "qcluster")
        wait_until(
            procs,
            "the cluster 30 s behind to claim work",
            lambda: _claims_by(procs, late) >= 2,
            timeout=60,
        )
        procs.env = ahead
        procs.start("qcluster-ahead", "qcluster")
        procs.start("dispatcher-ahead", "jobs_dispatcher", "--interval", "0.2")
    finally:
        procs.env = base
    wait_until(
        procs,
        "every job succeeded and every notice applied",
        lambda: (
            Job.objects.filter(state=Job.State.SUCCEEDED).count() == 12
            and Effect.objects.filter(provider="webhook", state=Effect.State.APPLIED).count() == 6
        ),
        timeout=90,
    )
    outcomes = Counter(Attempt.objects.values_list("outcome", flat=True))
    assert not outcomes[Attempt.Outcome.CRASHED] and not outcomes[Attempt.Outcome.LEASE_LOST], (
        f"no lease was taken early: {outcomes}"
    )
    assert set(Job.objects.values_list("attempts", flat=True)) == {1}, "one claim per job"
    claims = Counter(
        EffectEvent.objects.filter(action=EffectEvent.Action.CLAIM).values_list("effect", flat=True)
    )
    assert set(claims.values()) == {1}, f"no send claimed again while in flight: {claims}"
    requests = Counter(r["effect_id"] for r in provider.record.requests())
    assert len(requests) == 6 and set(requests.values()) == {1}, requests
    clusters = Counter()
    for worker in Attempt.objects.exclude(outcome="").values_list("worker", flat=True):
        owner = procs.owner_of(int(worker.rsplit(":", 2)[1]))
        clusters[owner.name if owner else "?"] += 1
    print(f"attempts by cluster: {dict(clusters)}")
    assert clusters["qcluster-behind"] and clusters["qcluster-ahead"], "both clocks did work"


def _claims_by(procs, proc) -> int:
    workers = Attempt.objects.filter(number__gt=0).values_list("worker", flat=True)
    return sum(procs.owner_of(int(w.rsplit(":", 2)[1])) is proc for w in workers)
