"""Per-provider in-flight bounds: slots in one process, and across worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.db import connection

from jobs.contrib.drills import burst
from jobs.models import Effect, Job
from jobs.providers import bounds
from jobs.testing.fakeprovider import Faults, start_in_thread
from tests.e2e.processes import site_processes
from tests.jobs.helpers import request_job
from tests.providers.conftest import TOKEN, subprocess_env, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.django_db
def test_bounds__no_more_than_the_limit_are_held_at_once():
    held = [bounds.try_acquire("bound-test", 3) for _ in range(3)]
    assert all(held) and sorted(s.index for s in held) == [0, 1, 2]
    assert bounds.try_acquire("bound-test", 3) is None, "a fourth holder would exceed 3"
    assert bounds.try_acquire("other-provider", 3) is not None, "bounds are per provider"
    freed = held.pop(1)
    freed.release()
    again = bounds.acquire("bound-test", 3, wait=0.5)
    assert again is not None and again.index == freed.index
    started = time.monotonic()
    assert bounds.acquire("bound-test", 3, wait=0.3) is None
    assert time.monotonic() - started >= 0.3, "waited for a slot before giving up"
    for slot in [*held, again]:
        slot.release()
    assert bounds.try_acquire("bound-test", 3) is not None


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_bounds__threads_on_their_own_connections_share_the_limit():
    inside = []
    peak = []
    lock = threading.Lock()

    def call(i):
        try:
            with bounds.in_flight("threads", 2, wait=10) as slot:
                assert slot is not None
                with lock:
                    inside.append(i)
                    peak.append(len(inside))
                time.sleep(0.1)
                with lock:
                    inside.remove(i)
        finally:
            connection.close()

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(call, range(12)))
    assert max(peak) == 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_bounds__slot_of_a_killed_process_is_free_again():
    script = (
        "import django, time; django.setup()\n"
        "from jobs.providers import bounds\n"
        "slot = bounds.try_acquire('killed', 1)\n"
        "print('held' if slot else 'busy', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout.readline().decode().strip() == "held"
        assert bounds.try_acquire("killed", 1) is None, "held by the other process"
    finally:
        proc.kill()
        proc.wait(10)
    slot = wait_for(lambda: bounds.try_acquire("killed", 1), what="the dead holder's slot")
    slot.release()


@pytest.mark.drill
@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_bounds__per_provider_bound_holds_with_several_worker_processes(
    make_user, tmp_path, settings
):
    """Five worker processes, 30 notices, bound 2: the provider never sees a third call."""
    bound, workers, notices = 2, 5, 30
    provider = start_in_thread(
        tmp_path / "provider.sqlite3", token=TOKEN, faults=Faults(delay=0.15)
    )
    user = make_user()
    run = "bound1"
    for i in range(notices):
        request_job(
            burst.KIND,
            subject_type=burst.SUBJECT_TYPE,
            subject_id=f"{run}-{i}",
            params={"recipient": user.pk, "provider": "webhook"},
        )
    config = burst.BurstConfig(max_in_flight=bound, effect_lease=10, slot_wait=1.0)
    env = subprocess_env(
        **{burst.CONFIG_ENV: json.dumps(config.settings(provider.url, TOKEN))},
    )
    harness = site_processes(env, tmp_path)
    procs = [
        harness.start(f"worker-{i}", "burst", "--worker", str(i), "--of", str(workers), run).popen
        for i in range(workers)
    ]
    try:
        effects = Effect.objects.filter(job__subject_id__startswith=f"{run}-")
        wait_for(
            lambda: (
                effects.filter(state=Effect.State.APPLIED).count() == notices
                or any(p.poll() is not None for p in procs)
            ),
            timeout=90,
            what="every notice to be applied",
        )
    finally:
        for proc in harness.procs:
            harness.terminate(proc, timeout=20)
        provider.stop()
    output = "\n".join((tmp_path / f"worker-{i}.log").read_text() for i in range(workers))
    assert all(p.returncode == 0 for p in procs), output[-3000:]
    assert Job.objects.filter(state=Job.State.SUCCEEDED).count() == notices
    assert effects.filter(state=Effect.State.APPLIED).count() == notices

    record = provider.record
    assert record.max_in_flight() == bound, "the bound is reached and never exceeded"
    assert len(record.sends()) == notices and record.duplicate_effects() == {}
    workers_seen = set(Effect.objects.values_list("events__actor", flat=True))
    assert len(workers_seen) == workers, "every process sent some notices"


@pytest.mark.django_db
def test_in_flight_now__counts_held_slots_for_the_gauge():
    from jobs.providers.bounds import in_flight_now, try_acquire
    from jobs.stats import provider_in_flight

    assert in_flight_now("gauge-test", 3) == 0
    first, second = try_acquire("gauge-test", 3), try_acquire("gauge-test", 3)
    try:
        assert first is not None and second is not None, "two of three slots were free"
        assert in_flight_now("gauge-test", 3) == 2
    finally:
        for slot in (first, second):
            if slot is not None:
                slot.release()
    assert in_flight_now("gauge-test", 3) == 0
    assert set(provider_in_flight()) >= {"webhook"}
