"""Processes that heal: ``jobs_worker`` and ``jobs_dispatcher`` through database outages.

Real processes against the real test database. The outages come from a
``DatabaseProxy`` (tests/chaos/dbproxy.py) the processes connect through: down, it
refuses connections and cuts the open ones, as a restarted server does; this test
process observes through its own direct connection. The failure before a claim
comes from PostgreSQL itself (``ALLOW_CONNECTIONS false`` on the test database:
new connections refused, open ones kept, the shape of "too many clients").

Timing from tests.settings: lease 2 s, Q_CLUSTER timeout 5 s, retry 7 s, one worker
per cluster, so jobs_worker's stall threshold is 6 s. Waits are generous deadlines;
the times to settle are printed, never asserted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest
from django.db import connection
from django_q.models import OrmQ

from jobs.artifacts import is_intact
from jobs.models import Artifact, Attempt, Effect, Job, Notice
from jobs.supervisor import group_members
from jobs.testing.proctree import children
from tests.chaos.dbproxy import DatabaseProxy
from tests.e2e.processes import (
    Processes,
    database_address,
    jobs_stats,
    local_ports,
    request_steps_job,
    subprocess_env,
    wait_until,
)

# The jobs table is the queue: no engine job or effect gets a django_q_ormq row at any
# point of these runs (a trigger sees every insert: tests/e2e/conftest.py).
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("no_engine_messages"),
]

State = Job.State
# ~1 s of heartbeated work per job: some are in flight whenever the database goes.
WORK = {"stages": 2, "after_stages": 1, "stage_sleep": 0.3}


@pytest.fixture
def proxy(procs):
    """A relay to the test database's server; closed before the processes are killed."""
    relay = DatabaseProxy(*database_address())
    yield relay
    relay.close()


def _request(user, count: int, *, first: int = 1, **params) -> list[Job]:
    """``count`` new jobs for ``user``, revisions ``first`` onwards."""
    return [
        request_steps_job(user, revision, tenant_key="e2e-outage", **params)
        for revision in range(first, first + count)
    ]


def _hold(procs: Processes, seconds: float) -> None:
    """Let ``seconds`` pass while checking that no process exits."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        procs.check_alive()
        time.sleep(0.2)


def _settle(procs: Processes, jobs: list[Job], since: float) -> float:
    """Wait until every job succeeded; seconds since ``since`` (monotonic)."""
    wait_until(
        procs,
        "every job to succeed",
        lambda: _states(jobs)[State.SUCCEEDED] == len(jobs),
        timeout=90,
    )
    return time.monotonic() - since


def _states(jobs: list[Job]) -> Counter:
    return Counter(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True))


def _assert_each_once(jobs: list[Job]) -> None:
    """Every job succeeded with one intact artifact, one applied effect, one notice."""
    for job in jobs:
        job.refresh_from_db()
        assert job.state == State.SUCCEEDED, (job.pk, job.state)
        artifacts = list(Artifact.objects.filter(job=job))
        assert len(artifacts) == 1 and is_intact(artifacts[0]), artifacts
        assert [e.state for e in Effect.objects.filter(job=job)] == [Effect.State.APPLIED]
        assert Notice.objects.filter(effect__job=job).count() == 1
        outcomes = Counter(Attempt.objects.filter(job=job).values_list("outcome", flat=True))
        assert outcomes[Attempt.Outcome.SUCCEEDED] == 1, (job.pk, outcomes)
    assert Notice.objects.count() == len(jobs)


def _back_once(procs: Processes, proc) -> None:
    """``proc`` logs the outage's end exactly once. It may log it after the jobs settled:
    a process that had nothing to do tries the database on its backoff (up to 5 s)."""
    pattern = rf"{proc.name}: database back after \d+\.\d s"
    wait_until(
        procs, f"{proc.name} to log the outage's end", lambda: _lines(proc, pattern), timeout=20
    )
    assert len(_lines(proc, pattern)) == 1, proc.name


def _lines(proc, pattern: str) -> list[str]:
    return [
        line
        for line in proc.log_path.read_text(errors="replace").splitlines()
        if re.search(pattern, line)
    ]


def _warm_up(procs: Processes, user) -> int:
    """Run a first job (revision 1); the pid of the process that claimed it (the claim's
    owner: the cluster's pusher, which claims for its workers)."""
    [job] = _request(user, 1)
    wait_until(
        procs,
        "a first job to succeed",
        lambda: Job.objects.get(pk=job.pk).state == State.SUCCEEDED,
        timeout=60,
    )
    assert not OrmQ.objects.exists(), "an engine job has no django_q_ormq row"
    return int(Attempt.objects.get(job=job).worker.split(":")[1])


def _cluster_of(worker, procs: Processes, *, other_than: int | None = None) -> int:
    """The pid of jobs_worker's qcluster child once its cluster runs (workers forked)."""

    def ready():
        kids = [k for k in children(worker.pid) if k != other_than]
        # main + sentinel + worker + monitor + pusher, all in the child's own group
        return kids[0] if len(kids) == 1 and len(group_members(kids[0])) >= 5 else None

    return wait_until(procs, "jobs_worker's qcluster to run", ready, timeout=60, interval=0.1)


# --- database outages ---------------------------------------------------------------


@pytest.mark.drill
def test_outage__database_restart_mid_run_settles_by_itself(procs, proxy, django_user_model):
    """The database vanishes for 7 s mid-run: every job still succeeds, exactly once.

    Both processes live through it; the dispatcher logs the outage once when it
    begins and once, with its length, when it ends.
    """
    user = django_user_model.objects.create_user(username="e2e-restart")
    jobs = _request(user, 10, **WORK)
    proxy.start()
    env = subprocess_env(port=proxy.port)
    worker = procs.start("jobs_worker", "jobs_worker", env=env)
    dispatcher = procs.start("jobs_dispatcher", "jobs_dispatcher", "--interval", "0.5", env=env)
    started = time.monotonic()

    wait_until(
        procs,
        "three jobs to succeed before the outage",
        lambda: _states(jobs)[State.SUCCEEDED] >= 3,
        timeout=60,
    )
    cluster = _cluster_of(worker, procs)
    django_q_processes = set(group_members(cluster))  # main, sentinel, monitor, pusher, workers
    before = _states(jobs)
    assert before[State.SUCCEEDED] < len(jobs), f"every job finished before the outage: {before}"
    proxy.down()
    down_at = time.monotonic()
    print(f"database down after {down_at - started:.1f} s with jobs {dict(before)}")
    _hold(procs, 7)  # nobody dies of it
    proxy.up()
    up_at = time.monotonic()
    settled = _settle(procs, jobs, up_at)
    print(
        f"OUTAGE_RESTART: 7 s outage; every job succeeded {settled:.1f} s after the database "
        f"came back ({time.monotonic() - started:.1f} s in all); {proxy.cut} connections cut"
    )
    _assert_each_once(jobs)
    stats = jobs_stats(subprocess_env())
    print("JOBS_STATS_AFTER_RESTART: " + json.dumps(stats, sort_keys=True))
    assert stats["duplicate_effects"] == 0, stats
    assert stats["jobs"]["by_state"] == {"succeeded": len(jobs)}, stats

    began = _lines(dispatcher, r"jobs_dispatcher: database unavailable \(OperationalError ")
    assert len(began) == 1, began
    _back_once(procs, dispatcher)
    procs.check_alive()
    # No django-q2 process died of it (its monitor calls acknowledge outside any try; a
    # broker statement or a signal receiver that raised would have killed one): the
    # same cluster, the same processes, nothing reincarnated.
    assert _cluster_of(worker, procs) == cluster
    assert set(group_members(cluster)) == django_q_processes
    assert not _lines(worker, r"reincarnated"), _lines(worker, r"reincarnated")


@pytest.mark.drill
def test_outage__every_app_connection_terminated_twice__no_django_q_process_dies(
    procs, django_user_model
):
    """An administrator ends every backend of the site's database mid-run, twice
    (``pg_terminate_backend``: the pusher's claim connection, its LISTEN connection, the
    workers', the monitor's, the supervisor's, the dispatcher's). On the jobs table as the
    queue: every job still succeeds exactly once, and no django-q2 process dies of it
    (the same cluster, the same processes, nothing reincarnated)."""
    user = django_user_model.objects.create_user(username="e2e-terminate")
    jobs = _request(user, 10, **WORK)
    worker = procs.start("jobs_worker", "jobs_worker")
    dispatcher = procs.start("jobs_dispatcher", "jobs_dispatcher", "--interval", "0.5")
    wait_until(
        procs,
        "two jobs to succeed before the first termination",
        lambda: _states(jobs)[State.SUCCEEDED] >= 2,
        timeout=60,
    )
    cluster = _cluster_of(worker, procs)
    django_q_processes = set(group_members(cluster))
    ended = []
    for _ in range(2):
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            ended.append(sum(1 for (done,) in cursor.fetchall() if done))
        _hold(procs, 2)
    terminated_at = time.monotonic()
    settled = _settle(procs, jobs, terminated_at)
    print(
        f"TERMINATED: {ended} backends ended in two rounds; every job succeeded "
        f"{settled:.1f} s after the second"
    )
    assert all(n >= 3 for n in ended), ended  # the cluster's and the dispatcher's at least
    _assert_each_once(jobs)
    procs.check_alive()
    assert _cluster_of(worker, procs) == cluster
    assert set(group_members(cluster)) == django_q_processes
    assert not _lines(worker, r"reincarnated"), _lines(worker, r"reincarnated")
    assert dispatcher.alive()


@pytest.mark.drill
def test_outage__database_down_at_start_up_then_everything_settles(procs, proxy, django_user_model):
    """Started while the database refuses connections (20 s), both wait; then all settles.

    jobs_worker does not start its qcluster before the database answers (django-q2's
    cluster would exit at once); neither process exits or logs more than once.
    """
    user = django_user_model.objects.create_user(username="e2e-cold-start")
    jobs = _request(user, 8, stages=1, stage_sleep=0.1)
    proxy.start(listening=False)
    env = subprocess_env(port=proxy.port)
    worker = procs.start("jobs_worker", "jobs_worker", env=env)
    dispatcher = procs.start("jobs_dispatcher", "jobs_dispatcher", "--interval", "0.5", env=env)
    started = time.monotonic()
    _hold(procs, 20)
    assert not children(worker.pid), "jobs_worker started qcluster while the database was down"
    assert _states(jobs) == Counter({State.QUEUED: len(jobs)})
    for proc in (worker, dispatcher):
        assert len(_lines(proc, r"database unavailable \(OperationalError ")) == 1, proc.name
    proxy.up()
    up_at = time.monotonic()
    settled = _settle(procs, jobs, up_at)
    print(
        f"OUTAGE_COLD_START: database down for the first {up_at - started:.1f} s; every job "
        f"succeeded {settled:.1f} s after it came up"
    )
    _assert_each_once(jobs)
    for proc in (worker, dispatcher):
        _back_once(procs, proc)
    assert _lines(worker, r"jobs_worker: started qcluster pid \d+")
    procs.check_alive()


# --- supervision ----------------------------------------------------------------------


def test_worker__restarts_a_killed_qcluster_and_stops_its_whole_group(procs, django_user_model):
    """SIGKILL of the qcluster: a new one runs (and works); SIGTERM leaves no process behind."""
    worker = procs.start("jobs_worker", "jobs_worker", "--stop-timeout", "10")
    first = _cluster_of(worker, procs)
    first_members = group_members(first)
    os.kill(first, signal.SIGKILL)  # the child exits; its sentinel and workers would linger

    second = _cluster_of(worker, procs, other_than=first)
    assert second != first
    assert not group_members(first), f"orphans of the killed cluster: {group_members(first)}"
    assert _lines(worker, rf"qcluster pid {first} exited with code -9; it ran \d+ s; restarting")

    user = django_user_model.objects.create_user(username="e2e-restarted")
    [job] = _request(user, 1)
    wait_until(
        procs,
        "the restarted cluster to run a job",
        lambda: Job.objects.get(pk=job.pk).state == State.SUCCEEDED,
        timeout=30,
    )
    second_members = group_members(second)
    assert len(second_members) >= 5, second_members

    worker.popen.send_signal(signal.SIGTERM)
    assert worker.popen.wait(timeout=30) == 0, worker.popen.returncode
    worker.killed = True  # it exited on purpose
    left = [pid for pid in {*first_members, *second_members, worker.pid} if _alive(pid)]
    assert not left, f"processes outlived jobs_worker's stop: {left}"
    assert not group_members(second) and not group_members(worker.pid)
    assert _lines(worker, r"qcluster pid \d+ and its process group ended")


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (os.kill(pid, 0) says yes to zombies)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_worker__restarts_a_cluster_that_stopped_making_progress(procs, django_user_model):
    """A cluster whose worker froze (SIGSTOP) while jobs wait is restarted (the wedge).

    The cluster process stays alive, its pusher keeps running, nothing runs: what
    django-q2's wedge looks like from outside. After the stall threshold jobs_worker
    replaces the cluster and the waiting jobs finish.
    """
    worker = procs.start("jobs_worker", "jobs_worker")
    cluster = _cluster_of(worker, procs)
    user = django_user_model.objects.create_user(username="e2e-stall")
    frozen = _warm_up(procs, user)
    assert frozen in group_members(cluster) and frozen != cluster
    os.kill(frozen, signal.SIGSTOP)
    stopped_at = time.monotonic()
    jobs = _request(user, 2, first=2)
    new = _cluster_of(worker, procs, other_than=cluster)
    restarted = time.monotonic() - stopped_at
    wait_until(
        procs,
        "the waiting jobs to succeed on the new cluster",
        lambda: _states(jobs)[State.SUCCEEDED] == len(jobs),
        timeout=60,
    )
    print(
        f"STALL: cluster {cluster} restarted {restarted:.1f} s after its worker froze; the "
        f"waiting jobs succeeded {time.monotonic() - stopped_at:.1f} s after"
    )
    assert not group_members(cluster), "the stalled cluster's group outlived the restart"
    assert new != cluster
    [line] = _lines(worker, rf"qcluster pid {cluster} made no progress for \d+ s while ")
    print(line)
    # On the jobs table as the queue the sign is the jobs due and not claimed for over
    # grace (5 s): the frozen worker's slot stays taken, so the pusher claims nothing.
    assert "job(s) due for over 5 s and not claimed" in line, line


# --- failures before the claim are counted -----------------------------------------


def _set_allow_connections(allow: bool) -> None:
    """ALLOW_CONNECTIONS on the test database, from the server's maintenance database."""
    host, port = database_address()
    name = connection.settings_dict["NAME"]
    user = connection.settings_dict.get("USER") or "root"
    with psycopg.connect(host=host, port=port, user=user, dbname="postgres", autocommit=True) as c:
        c.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"true" if allow else "false"}')


def test_worker__a_claim_refused_its_connection_records_nothing_and_claims_once_back(
    no_engine_messages, procs, django_user_model
):
    """The claiming process's connection is gone and PostgreSQL refuses new ones: no
    claim can be made while the refusal lasts.

    Nothing is recorded for the job meanwhile (no attempt row, still queued: no message
    to fail or redeliver), no process dies of it, and once connections are allowed
    again the job is claimed from its row and succeeds with one attempt.
    """
    # Claims by the pusher alone: a worker that has just finished the warm-up job
    # claims the next one itself (its follow-on) on a connection this test leaves up,
    # and on a loaded machine it did so after the request below.
    worker = procs.start(
        "jobs_worker", "jobs_worker", env={**procs.env, "JOBS_FOLLOW_ON_SECONDS": "0"}
    )
    user = django_user_model.objects.create_user(username="e2e-refused")
    claimer_pid = _warm_up(procs, user)  # the pusher and the workers hold connections now
    ports = local_ports(claimer_pid)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND client_port = ANY(%s)",
            [list(ports)],
        )
        backends = [row[0] for row in cursor.fetchall()]
    assert backends, f"claimer {claimer_pid} ports {ports}: no backend"

    _set_allow_connections(False)
    try:
        with connection.cursor() as cursor:
            for backend in backends:
                cursor.execute("SELECT pg_terminate_backend(%s)", [backend])
        [job] = _request(user, 1, first=2)
        _hold(procs, 5)  # the claimer tries and is refused; nobody dies of it
        job.refresh_from_db()
        assert job.state == State.QUEUED, job.state
        assert not Attempt.objects.filter(job=job).exists(), "a refused claim left an attempt"
    finally:
        _set_allow_connections(True)
    refused_at = time.monotonic()

    wait_until(
        procs,
        "the job to be claimed once connections are back",
        lambda: Job.objects.get(pk=job.pk).state == State.SUCCEEDED,
        timeout=40,
    )
    print(f"REFUSED: the job succeeded {time.monotonic() - refused_at:.1f} s after the refusal")
    assert Attempt.objects.filter(job=job).count() == 1
    procs.check_alive()
    assert worker.alive()
    stats = jobs_stats(subprocess_env())
    print("JOBS_STATS_AFTER_REFUSAL: " + json.dumps(stats, sort_keys=True))
    assert stats["jobs"]["by_state"] == {"succeeded": 2}, stats
    assert stats["duplicate_effects"] == 0, stats
    no_engine_messages.assert_no_engine_message()
