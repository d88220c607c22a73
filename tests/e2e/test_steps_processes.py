"""Durable steps under real processes: the DBOS scenario (issue 31, acceptance 3).

A kind with two steps (tests/testapp/kinds.py ``test.dbos_steps``): step 1 renders, step 2
sends one request to the stand-in provider with ``ctx.step_key("send")`` as its
Idempotency-Key. The worker running attempt 1 is frozen (SIGSTOP) inside step 2 after its
call; its lease (2 s, tests/settings.py) runs out, the dispatcher re-drives the job, the
other cluster's worker claims it, reuses step 1, sends again with the same key (the
provider replays, it does not apply twice) and publishes. Then the frozen worker goes on
(SIGCONT): its step 2 record is refused by the fence, so it never reaches a publish.

The whole frozen cluster is stopped, not only its worker process: with one worker per
cluster, its pusher would otherwise take the re-drive message into its one-slot queue
behind the frozen worker, and nobody would run it until django-q2's ``retry``. A cluster
frozen whole is a paused host (a VM pause, a stop-the-world stall).

Counts come from outside the workers' memory: the handler appends a line per fn run to a
file, the provider keeps its own record, the database has the rows.

Run twice (issue 43): with step 2's ``lookup`` the reclaiming worker finds the step begun,
asks the provider ``GET /notices/{key}``, records the id it gets and sends nothing: one
POST for the key, the lookup counted apart; without it, it sends again (two POSTs, the
second a replay). The second run prints both side by side.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from jobs import identity
from jobs.models import Artifact, Attempt, Effect, Job, JobStep, Notice
from tests.e2e.processes import job_table, wait_until
from tests.jobs.helpers import request_job
from tests.testapp.kinds import DBOS_KIND

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


def _worker_pid(worker: str) -> int:
    host, pid, _nonce = worker.rsplit(":", 2)
    assert host == socket.gethostname(), f"worker {worker} is not on this host"
    return int(pid)


def _runs(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _log(proc) -> str:
    return proc.log_path.read_text(errors="replace")


SIDE_BY_SIDE: dict[str, dict] = {}  # lookup available or not -> what the provider saw


@pytest.mark.parametrize("lookup", [True, False], ids=["with_lookup", "without_lookup"])
def test_steps__a_worker_frozen_inside_step_2_after_its_call_cannot_record_or_publish(
    procs, provider, django_user_model, tmp_path, lookup
):
    user = django_user_model.objects.create_user(username="e2e-steps")
    runs_file, go_file = tmp_path / "runs.txt", tmp_path / "go"
    clusters = [procs.start("qcluster-a", "qcluster"), procs.start("qcluster-b", "qcluster")]
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.2")
    job, _ = request_job(
        DBOS_KIND,
        subject_type="auth.user",
        subject_id=user.pk,
        tenant_key="e2e",
        params={
            "recipient": user.pk,
            "provider": provider.url,
            "runs_file": str(runs_file),
            "go_file": str(go_file),
            "lookup": lookup,
        },
    )
    key = f"job-{identity.job_key(job)}-r{job.output_revision}-step-send"

    wait_until(
        procs,
        "step 2's call to reach the provider",
        lambda: provider.record.requests_for(key),
        timeout=60,
        interval=0.02,
    )
    stale = Attempt.objects.get(job=job, outcome="")
    pid = _worker_pid(stale.worker)
    frozen = procs.owner_of(pid)
    assert frozen in clusters and pid != frozen.pid, f"{stale.worker} is not one of our workers"
    os.kill(pid, signal.SIGSTOP)  # the worker first: it must not get to its record
    os.killpg(frozen.pid, signal.SIGSTOP)  # then its cluster (the pusher: see above)
    stopped_at = time.monotonic()
    done = JobStep.objects.filter(job=job, name="send", finished_at__isnull=False)
    assert not done.exists(), "step 2 was recorded"
    assert JobStep.objects.filter(job=job, name="send").exists() == lookup, "begun iff lookup"
    print(f"froze {stale.worker} of {frozen.name} inside step 2, after its call")

    done = wait_until(
        procs,
        "the other worker to reclaim and publish",
        lambda: Job.objects.filter(pk=job.pk, state=Job.State.SUCCEEDED).first(),
        timeout=60,
    )
    reclaimed_in = time.monotonic() - stopped_at
    go_file.touch()
    os.killpg(frozen.pid, signal.SIGCONT)
    refused = f"step=send refused: worker={stale.worker} no longer holds the job"
    # The reclaim marked the frozen worker's attempt crashed (it could not know); the
    # resumed worker, refused at its record, ends it as a lost lease.
    wait_until(
        procs,
        "the resumed worker to end its attempt",
        lambda: Attempt.objects.filter(pk=stale.pk, outcome=Attempt.Outcome.LEASE_LOST).exists(),
        timeout=60,
    )
    print(f"published by another worker {reclaimed_in:.1f} s after the freeze; resumed")

    job.refresh_from_db()
    stale.refresh_from_db()
    runs = _runs(runs_file)
    calls = provider.record.requests_for(key)
    applied = [s for s in provider.record.sends() if s["idempotency_key"] == key]
    steps = {s.name: s for s in JobStep.objects.filter(job=job)}
    attempts = list(Attempt.objects.filter(job=job).order_by("id"))
    counts = {
        "render_fn_runs": sum(r.startswith("render") for r in runs),
        "send_fn_runs": sum(r.startswith("send") for r in runs),
        "lookup_available": lookup,
        "provider_requests_for_key": len(calls),
        "provider_lookups_for_key": len(provider.record.lookups_for(key)),
        "lookup_fn_runs": sum(r.startswith("lookup") for r in runs),
        "provider_applied_for_key": len(applied),
        "provider_statuses": [c["status"] for c in calls],
        "job_steps": sorted(steps),
        "artifacts": Artifact.objects.filter(job=job).count(),
        "effects": Effect.objects.filter(job=job).count(),
        "attempts": [(a.number, a.outcome) for a in attempts],
        "stale_attempt": stale.outcome,
        "frozen_past_q_alarm": "alarm swallowed" in runs,
    }
    print(f"DBOS_SCENARIO_COUNTS: {counts}\n{job_table()}")
    SIDE_BY_SIDE["with_lookup" if lookup else "without_lookup"] = {
        "provider_requests_for_key": len(calls),
        "provider_lookups_for_key": counts["provider_lookups_for_key"],
        "send_fn_runs": counts["send_fn_runs"],
    }
    print(f"DBOS_SCENARIO_SIDE_BY_SIDE: {SIDE_BY_SIDE}")

    assert job.state == Job.State.SUCCEEDED
    assert job.version == done.version, "the resumed worker wrote to the job"
    assert refused in _log(frozen), "the resumed worker was not refused at its step record"
    if lookup:
        # Step 2's begun record (before its call) carried step 1's along: reused.
        assert counts["render_fn_runs"] == 1, f"step 1's fn ran more than once: {runs}"
        # The reclaim found step 2 begun, asked the provider, and recorded its answer.
        assert counts["send_fn_runs"] == 1, runs
        assert counts["lookup_fn_runs"] >= 1 and counts["provider_lookups_for_key"] >= 1
        assert counts["provider_statuses"] == [201], "one POST for the key: no second send"
    else:
        # Quick step 1 waited for the next fenced write (jobs.delivery.steps.RIDE_SECONDS),
        # which the frozen worker never made: the reclaim ran it again (the record is once).
        assert counts["render_fn_runs"] in (1, 2), runs
        assert counts["send_fn_runs"] >= 2, runs  # the frozen worker's call and the reclaim's
        assert counts["provider_lookups_for_key"] == 0
        statuses = counts["provider_statuses"]
        assert statuses[0] == 201 and set(statuses[1:]) == {200}, statuses  # then replays
    assert len(calls) == counts["send_fn_runs"], "one provider request per run of step 2's fn"
    assert len(applied) == 1, f"the provider applied the step's key {len(applied)} times"
    assert set(steps) == {"render", "send"}
    if lookup:  # recorded before the freeze, with step 2's begun record
        assert steps["render"].worker == stale.worker
    assert steps["send"].worker != stale.worker  # the frozen worker's output was refused
    winner = next(a for a in attempts if a.outcome == Attempt.Outcome.SUCCEEDED)
    assert steps["send"].worker == winner.worker
    assert counts["artifacts"] == 1 and counts["effects"] == 1
    assert Notice.objects.filter(effect__job=job).count() == 1
    assert stale.outcome == Attempt.Outcome.LEASE_LOST
    assert sum(a.outcome == Attempt.Outcome.SUCCEEDED for a in attempts) == 1
