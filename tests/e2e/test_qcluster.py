"""Real ``manage.py qcluster`` processes: crashes, reclaims and whole outcomes.

Every test here starts django-q2 clusters (and the dispatcher loop) as separate
processes against the test database pytest-django created, then kills parts of
them with SIGKILL. The guarantees checked are the design's invariants 1-4 and 9:
one artifact, one effect, one notice per job whatever dies; an outcome is committed
whole (no snapshot shows a job finished without its artifact and notice); an expired
lease is claimed again from the job's row; duplicate effects stay 0. The jobs table is
the queue: a trigger (``no_engine_messages``) sees every ``django_q_ormq`` insert of
the whole test, and none may be an engine job's or effect's.

Timing comes from tests.settings: lease 2 s, Q_CLUSTER timeout 5 s, retry 7 s,
poll 0.1 s, one worker per cluster. Nothing here asserts a duration: waits are
generous deadlines that fail with the processes' logs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass

import pytest
from django.db.models import Exists, OuterRef
from django_q.tasks import async_task

from jobs import rules
from jobs.artifacts import artifact_key, get_storage, is_intact
from jobs.models import Artifact, Attempt, Effect, Job, Notice
from jobs.testing.proctree import children, process_table
from tests.e2e.processes import (
    Processes,
    job_table,
    jobs_stats,
    request_steps_job,
    wait_until,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("no_engine_messages"),
]

Outcome = Attempt.Outcome
State = Job.State

# A job of ~2.8 s (well under Q_CLUSTER timeout 5 s): the artifact is stored after
# the first 0.4 s stage, then six heartbeated stages leave a wide window to kill.
LONG_JOB = {"stages": 1, "after_stages": 6, "stage_sleep": 0.4}


# --- helpers -----------------------------------------------------------------------


def _request(user, revision: int, **params) -> Job:
    return request_steps_job(user, revision, tenant_key="e2e", **params)


def _running_processes(pid: int) -> list[int]:
    """The processes that may run the attempt ``pid`` claimed: ``pid`` is the cluster's
    pusher (the claiming broker claims), which hands the claim to any of its workers:
    every sibling of the pusher (the workers and the monitor, which django-q2's sentinel
    starts again)."""
    table = process_table()
    return [p for p in children(table[pid][0], table) if p != pid]


def _worker_pid(worker: str) -> int:
    host, pid, _nonce = worker.rsplit(":", 2)
    assert host == socket.gethostname(), f"worker {worker} is not on this host"
    return int(pid)


def _open_attempt_of_stored_running_job(job: Job) -> Attempt | None:
    """The open Attempt, once the job is running and its artifact file is stored (the
    row commits with the publish)."""
    current = Job.objects.get(pk=job.pk)
    folder = f"jobs/{job.kind.replace('.', '-')}"
    files = get_storage().listdir(folder)[1] if get_storage().exists(folder) else []
    stored = any(name.startswith(f"{artifact_key(job)}-") for name in files)
    if current.state != State.RUNNING or not stored:
        return None
    attempt = Attempt.objects.filter(job=job, outcome="", worker=current.lease_owner).first()
    return attempt


def _assert_exactly_once(job: Job, user) -> None:
    """One artifact (bytes match the row), one applied effect, one notice."""
    artifacts = list(Artifact.objects.filter(job=job))
    assert len(artifacts) == 1, f"expected one artifact, got {artifacts}"
    assert is_intact(artifacts[0]), f"stored bytes of {artifacts[0].key} do not match sha256"
    effects = list(Effect.objects.filter(job=job))
    assert len(effects) == 1, f"expected one effect, got {effects}"
    assert effects[0].state == Effect.State.APPLIED, effects[0].state
    assert effects[0].recipient == str(user.pk)
    notices = list(Notice.objects.filter(effect__job=job))
    assert len(notices) == 1, f"expected one notice, got {notices}"
    assert notices[0].recipient_id == user.pk
    assert Notice.objects.count() == 1


def _jobs_stats(procs: Processes) -> dict:
    return jobs_stats(procs.env)


# --- tests -------------------------------------------------------------------------


def test_qcluster__sigkill_mid_job_finishes_exactly_once(
    no_engine_messages, procs, django_user_model
):
    """A worker SIGKILLed after storing the artifact: the job still ends exactly once.

    Its lease runs out and a cluster claims the job again from its row (no message to
    redeliver), verifies the stored artifact and publishes. No engine job or effect
    ever had a ``django_q_ormq`` row; a plain task sent beside it had one.
    """
    user = django_user_model.objects.create_user(username="e2e-reviewer")
    job = _request(user, 1, **LONG_JOB)
    # A plain django-q2 task keeps its message: the trigger's witness that it sees inserts.
    async_task("math.floor", 2.5)

    clusters = [procs.start("qcluster-a", "qcluster"), procs.start("qcluster-b", "qcluster")]
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.5")

    victim = wait_until(
        procs,
        f"job {job.pk} running with its artifact stored",
        lambda: _open_attempt_of_stored_running_job(job),
        timeout=45,
        interval=0.02,
    )
    pid = _worker_pid(victim.worker)
    owner = procs.owner_of(pid)
    assert owner in clusters, f"pid {pid} of {victim.worker} is not a worker of our clusters"
    assert pid != owner.pid, "the job must run in a django-q2 worker child, not the main process"
    for running in _running_processes(pid):
        os.kill(running, signal.SIGKILL)
        print(f"killed pid {running} of {owner.name} ({victim.worker}) mid-job")
    assert Job.objects.get(pk=job.pk).state == State.RUNNING, "the job finished before the kill"

    wait_until(
        procs,
        f"job {job.pk} to succeed after the worker was killed",
        lambda: Job.objects.get(pk=job.pk).state == State.SUCCEEDED,
        timeout=60,
    )
    job.refresh_from_db()
    assert job.state == State.SUCCEEDED
    # Normally two claims (killed + reclaim). On a slow database a reclaiming delivery
    # can itself overrun Q_CLUSTER timeout and be killed: more claims, still one outcome.
    assert job.attempts >= 2, f"the killed claim and a reclaim expected, got {job.attempts}"
    _assert_exactly_once(job, user)

    victim.refresh_from_db()
    assert victim.outcome in (Outcome.CRASHED, Outcome.LEASE_LOST), victim.outcome
    attempts = list(Attempt.objects.filter(job=job).order_by("id"))
    outcomes = Counter(a.outcome for a in attempts)
    assert outcomes[Outcome.SUCCEEDED] == 1, outcomes
    assert outcomes[Outcome.CRASHED] + outcomes[Outcome.LEASE_LOST] == job.attempts - 1, outcomes
    # No message to redeliver: the expired lease was claimed again from the row.
    assert outcomes[Outcome.DUPLICATE_DELIVERY] == 0, outcomes
    no_engine_messages.assert_no_engine_message()
    funcs = [func for _id, _key, func in no_engine_messages.rows()]
    assert "math.floor" in funcs, f"the trigger saw no plain task's message: {funcs}"
    allowed = {Outcome.SUCCEEDED, Outcome.CRASHED, Outcome.LEASE_LOST, Outcome.DUPLICATE_DELIVERY}
    assert set(outcomes) <= allowed, outcomes

    stats = _jobs_stats(procs)
    print("JOBS_STATS_AFTER_CRASH: " + json.dumps(stats, sort_keys=True))
    assert stats["duplicate_effects"] == 0, stats
    assert stats["duplicate_deliveries"] == outcomes[Outcome.DUPLICATE_DELIVERY], stats
    assert stats["crashes"] + stats["lease_losses"] == job.attempts - 1, stats
    assert stats["effects"]["by_state"] == {"applied": 1}, stats
    assert stats["jobs"]["by_state"] == {"succeeded": 1}, stats


@dataclass(frozen=True)
class Seen:
    """One consistent snapshot (a single SELECT) of a job and what its outcome wrote."""

    state: str
    finished: bool
    artifact: bool
    notice: bool

    @property
    def done(self) -> bool:
        return self.state == State.SUCCEEDED and self.finished and self.artifact and self.notice


def _snapshot(job: Job) -> Seen:
    row = (
        Job.objects.filter(pk=job.pk)
        .annotate(
            has_artifact=Exists(Artifact.objects.filter(job=OuterRef("pk"))),
            has_notice=Exists(Notice.objects.filter(effect__job=OuterRef("pk"))),
        )
        .values_list("state", "finished_at", "has_artifact", "has_notice")
        .get()
    )
    state, finished_at, artifact, notice = row
    return Seen(state, finished_at is not None, artifact, notice)


def test_qcluster__an_outcome_commits_whole_and_a_killed_clusters_job_is_claimed_from_its_row(
    no_engine_messages, procs, django_user_model
):
    """The jobs table is the queue, and the job's state change is its acknowledgement.

    Part 1 watches a healthy run: no snapshot shows the job terminal without its
    artifact and notice, and while it runs it is held under its cluster's lease. Part 2
    kills a whole cluster mid-job: nothing is left to acknowledge or redeliver; once
    the lease runs out a new cluster, with no dispatcher running, claims the job from
    its row and finishes it exactly once. No ``django_q_ormq`` row for either job.
    """
    user = django_user_model.objects.create_user(username="e2e-ack")

    # Part 1: the outcome is committed whole.
    job = _request(user, 1, **LONG_JOB)
    first = procs.start("qcluster-1", "qcluster")
    seen: list[Seen] = []
    deadline = time.monotonic() + 45
    while True:
        now = _snapshot(job)
        seen.append(now)
        if now.state in Job.TERMINAL:
            break
        procs.check_alive()
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert seen[-1].done, (
        f"job {job.pk} did not finish whole in 45s; last {seen[-1]}\n{job_table()}"
    )
    half = [s for s in seen if (s.state in Job.TERMINAL or s.finished) and not s.done]
    assert not half, f"a terminal job without its artifact or notice: {Counter(half)}"
    running = [s for s in seen if s.state == State.RUNNING]
    assert running, f"never observed job {job.pk} running: {Counter(seen)}"
    assert not any(s.notice for s in running), "a notice before the outcome committed"
    assert Attempt.objects.get(job=job).outcome == Outcome.SUCCEEDED
    _assert_exactly_once(job, user)

    # Part 2: a cluster killed mid-job; its job is claimed again from its row.
    job2 = _request(user, 2, **LONG_JOB)
    victim = wait_until(
        procs,
        f"job {job2.pk} running with its artifact stored",
        lambda: _open_attempt_of_stored_running_job(job2),
        timeout=30,
        interval=0.02,
    )
    assert procs.owner_of(_worker_pid(victim.worker)) is first
    procs.kill_group(first)
    print(f"killed the whole cluster {first.name} (pgid {first.pid}) while job {job2.pk} ran")

    assert _snapshot(job2).state == State.RUNNING
    # Nothing is alive to renew the lease: it runs out, and the job stays running (no
    # one else decides about it) until a cluster claims it again.
    wait_until(
        procs,
        f"job {job2.pk}'s lease to expire",
        lambda: Job.objects.filter(rules.to_q(rules.JOB_LEASE_EXPIRED), pk=job2.pk).exists(),
        timeout=15,
    )
    assert _snapshot(job2).state == State.RUNNING
    assert Attempt.objects.get(pk=victim.pk).outcome == ""

    second = procs.start("qcluster-2", "qcluster")
    wait_until(
        procs,
        f"job {job2.pk} to succeed, claimed again from its row",
        lambda: Job.objects.get(pk=job2.pk).state == State.SUCCEEDED,
        timeout=45,
    )

    job2.refresh_from_db()
    assert job2.attempts >= 2, job2.attempts
    attempts = list(Attempt.objects.filter(job=job2).order_by("id"))
    outcomes = Counter(a.outcome for a in attempts)
    assert outcomes[Outcome.SUCCEEDED] == 1, outcomes
    assert outcomes[Outcome.CRASHED] + outcomes[Outcome.LEASE_LOST] == job2.attempts - 1, outcomes
    assert outcomes[Outcome.DUPLICATE_DELIVERY] == 0, "no message to redeliver"
    allowed = {Outcome.SUCCEEDED, Outcome.CRASHED, Outcome.LEASE_LOST}
    assert set(outcomes) <= allowed, outcomes
    assert Attempt.objects.get(pk=victim.pk).outcome == Outcome.CRASHED
    winner = next(a for a in attempts if a.outcome == Outcome.SUCCEEDED)
    assert procs.owner_of(_worker_pid(winner.worker)) is second, (
        f"the reclaim should have run in {second.name}: {winner.worker}"
    )
    artifacts = list(Artifact.objects.filter(job=job2))
    assert len(artifacts) == 1 and is_intact(artifacts[0]), artifacts
    effects = list(Effect.objects.filter(job=job2))
    assert [e.state for e in effects] == [Effect.State.APPLIED], effects
    assert Notice.objects.filter(effect__job=job2).count() == 1
    assert Notice.objects.count() == 2  # one per job, both jobs
    no_engine_messages.assert_no_engine_message()


def test_qcluster__a_killed_hosts_lease_is_claimed_again_ahead_of_100_queued_jobs(
    no_engine_messages, procs, django_user_model
):
    """Issue 41's recovery point on real clusters: a cluster SIGKILLed whole while it holds
    a lease, with 100 short jobs queued behind. The other cluster claims the expired job
    from its row (no message, no dispatcher running) ahead of the queue, and the job ends
    exactly once. The delay after the lease ran out is printed, not asserted."""
    user = django_user_model.objects.create_user(username="e2e-recovery")
    job = _request(user, 1, **LONG_JOB)
    others = django_user_model.objects.create_user(username="e2e-recovery-queue")
    # Queued behind it: 100 jobs of 0.1 s, 10 s of work for one worker (the lease is 2 s).
    short = [_request(others, 1 + i, stages=1, stage_sleep=0.1) for i in range(100)]
    first = procs.start("qcluster-a", "qcluster")  # one worker: it takes the oldest job
    wait_until(
        procs,
        f"job {job.pk} running with its artifact stored",
        lambda: _open_attempt_of_stored_running_job(job),
        timeout=45,
        interval=0.02,
    )
    procs.kill_group(first)
    killed = Job.objects.get(pk=job.pk)
    assert killed.state == State.RUNNING, "the job finished before the kill"
    expired_at = killed.lease_expires_at
    print(f"killed {first.name}; job {job.pk}'s lease runs out at {expired_at}")
    procs.start("qcluster-b", "qcluster")
    wait_until(
        procs,
        "the killed job and the 100 queued ones to succeed",
        lambda: (
            Job.objects.filter(pk__in=[job.pk] + [s.pk for s in short])
            .exclude(state=State.SUCCEEDED)
            .count()
            == 0
        ),
        timeout=120,
    )
    reclaim = Attempt.objects.get(job=job, number=2)
    last_short = max(Attempt.objects.filter(job__in=short).values_list("started_at", flat=True))
    delay = (reclaim.started_at - expired_at).total_seconds()
    done = Attempt.objects.filter(job__in=short, started_at__lt=reclaim.started_at).count()
    print(f"RECOVERY: claimed again {delay:.2f} s after its lease ran out (lease 2 s),")
    print(f"RECOVERY: after {done} of the 100 queued jobs had started")
    assert reclaim.started_at < last_short, "the expired lease waited behind the queue"
    no_engine_messages.assert_no_engine_message()  # at any point, not only now
    assert Artifact.objects.filter(job=job).count() == 1
    assert is_intact(Artifact.objects.get(job=job))
    assert Notice.objects.filter(effect__job=job).count() == 1
    assert Notice.objects.count() == 101, "one notice per job"
