"""Real ``manage.py qcluster`` processes on the claiming broker (``jobs.claiming``).

The clusters run ``tests.broker_settings`` (tests.settings with the claiming broker's
knobs from the environment) with ``poll`` at 5 s and the broker's heartbeat at 30 s, so
every pickup faster than that came from a NOTIFY or from the timed wake at the nearest
due time, never from a poll. This process enqueues through the same broker (django-q2's
``Conf`` is patched), inside the transaction that makes the job, as the site does. The
jobs table is the queue: no engine job has a ``django_q_ormq`` row.

What is checked: an idle cluster picks a job up within tens of ms; a retry is claimed at
its due time with no dispatcher running; two clusters share a burst, each job claimed
once; the LISTEN connection terminated by ``pg_terminate_backend`` is reopened, nothing
is lost and latency is back within 5 s; the database going away under running workers (a
relay that cuts every connection and refuses new ones, as a restart does) loses nothing;
an idle cluster's transactions per second, counted at the server (``pg_stat_database``),
against the ORM claiming broker's (which polls).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from datetime import timedelta

import psycopg
import pytest
from django.db import connection, transaction
from django.utils import timezone
from django_q.conf import Conf
from django_q.models import OrmQ, Schedule

from jobs.models import Attempt, Effect, Job, Notice
from jobs.testing.scratchdb import url_from_settings
from tests.chaos.dbproxy import DatabaseProxy
from tests.e2e.processes import (
    database_address,
    request_steps_job,
    subprocess_env,
    wait_until,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("no_engine_messages"),
]

State = Job.State
Outcome = Attempt.Outcome
LISTENER = "django-q2 listener%"
LONG_JOB = {"stages": 1, "after_stages": 6, "stage_sleep": 0.4}  # ~2.8 s, under timeout 5 s


@pytest.fixture
def pg_broker(monkeypatch):
    """This process enqueues through the claiming broker, as the clusters dequeue."""
    monkeypatch.setattr(Conf, "BROKER_CLASS", "jobs.claiming.ClaimingBroker")


def _env(*, port: int | None = None, broker: bool = True, **extra: str) -> dict[str, str]:
    env = subprocess_env(port=port)
    env["DJANGO_SETTINGS_MODULE"] = "tests.broker_settings"
    if broker:
        env.update(Q_BROKER_HEARTBEAT="30", Q_POLL="5")
    else:  # the ORM's claiming broker: it polls every ``poll`` (tests.settings: 0.1 s)
        env["TEST_BROKER_CLASS"] = "jobs.claiming_orm.OrmClaimingBroker"
    env.update(extra)
    return env


def _admin() -> psycopg.Connection:
    """A session on the server's maintenance database: reading counters adds nothing here."""
    db = connection.settings_dict
    return psycopg.connect(url_from_settings(db, name="postgres"), autocommit=True)


def _listeners(admin: psycopg.Connection) -> list[int]:
    rows = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name LIKE %s",
        [connection.settings_dict["NAME"], LISTENER],
    ).fetchall()
    return [pid for (pid,) in rows]


def _request(user, revision: int, **params) -> tuple[Job, object]:
    """A job asked for in its own transaction; returns it and the commit instant."""
    with transaction.atomic():
        job = request_steps_job(user, revision, tenant_key="e2e", **params)
    return job, timezone.now()


def _latency_ms(procs, job: Job, at) -> float:
    wait_until(
        procs,
        f"job {job.pk} to succeed",
        lambda: Job.objects.filter(pk=job.pk, state=State.SUCCEEDED).exists(),
        timeout=30,
        interval=0.005,
    )
    job.refresh_from_db()
    return (job.finished_at - at).total_seconds() * 1000


def _start_cluster(procs, name: str, env: dict[str, str], admin, user, revision: int):
    """Start a qcluster, wait until it listens (when on the broker) and ran one job."""
    cluster = procs.start(name, "qcluster", env=env)
    job, at = _request(user, revision)
    _latency_ms(procs, job, at)
    if "TEST_BROKER_CLASS" not in env:
        wait_until(procs, "the listener", lambda: _listeners(admin), timeout=30)
    return cluster


def _running_attempt(procs, job: Job) -> Attempt:
    return wait_until(
        procs,
        f"job {job.pk} running",
        lambda: Attempt.objects.filter(job=job, outcome="").first(),
        timeout=30,
        interval=0.02,
    )


def _one_outcome(job: Job, user) -> None:
    assert Effect.objects.filter(job=job).count() == 1
    assert Notice.objects.filter(effect__job=job, recipient_id=user.pk).count() == 1


def test_broker__idle_cluster_picks_a_job_up_within_tens_of_ms(procs, pg_broker, django_user_model):
    user = django_user_model.objects.create_user(username="broker-idle")
    with _admin() as admin:
        _start_cluster(procs, "qcluster", _env(), admin, user, 1)
        values = []
        for k in range(8):
            time.sleep(0.3 + 0.1 * (k % 3))  # idle: the pusher waits on LISTEN
            job, at = _request(user, 10 + k)
            values.append(_latency_ms(procs, job, at))
    p50 = statistics.median(values)
    print(
        f"\nidle single job, enqueue commit → succeeded (ms): p50 {p50:.0f}, max "
        f"{max(values):.0f}: {' '.join(f'{v:.0f}' for v in values)} (poll 5 s)"
    )
    assert p50 < 100, values
    assert max(values) < 1000, f"a pickup took a poll, not a NOTIFY: {values}"


def test_broker__a_retry_is_taken_at_its_due_time_with_no_dispatcher_running(
    procs, pg_broker, django_user_model
):
    """The retry's due time is on its row (no message) and the idle pusher wakes at it (the
    nearest due time): with poll 5 s, the heartbeat 30 s and no dispatcher (its schedule
    an hour away), only that timed wake can start the second attempt soon."""
    Schedule.objects.filter(name="jobs.dispatch").update(
        next_run=timezone.now() + timedelta(hours=1)
    )
    user = django_user_model.objects.create_user(username="broker-retry")
    with _admin() as admin:
        _start_cluster(procs, "qcluster", _env(), admin, user, 1)
        lateness = []
        for k in range(3):
            job, _at = _request(user, 20 + k, fail={"1": "temporary"})
            _latency_ms(procs, job, _at)
            first, second = Attempt.objects.filter(job=job).order_by("number")
            assert (first.outcome, second.outcome) == (Outcome.RETRY, Outcome.SUCCEEDED)
            due = first.finished_at + timedelta(seconds=first.retry_delay_seconds)
            lateness.append((second.started_at - due).total_seconds() * 1000)
            _one_outcome(job, user)
    print(f"\nretry started after its due time (ms): {' '.join(f'{v:.0f}' for v in lateness)}")
    assert max(lateness) < 2000, f"a retry waited for a poll or a heartbeat: {lateness}"


def test_broker__two_clusters_share_a_burst_each_job_claimed_once(
    procs, pg_broker, django_user_model
):
    """One NOTIFY wakes both pushers; SKIP LOCKED hands each job to one of them."""
    user = django_user_model.objects.create_user(username="broker-two")
    with _admin() as admin:
        clusters = [_start_cluster(procs, "qcluster-a", _env(), admin, user, 1)]
        clusters.append(_start_cluster(procs, "qcluster-b", _env(), admin, user, 2))
        wait_until(procs, "two listeners", lambda: len(_listeners(admin)) == 2, timeout=30)
    with transaction.atomic():
        jobs = [request_steps_job(user, 10 + k, tenant_key="e2e") for k in range(40)]
    wait_until(
        procs,
        "the burst to succeed",
        lambda: (
            Job.objects.filter(pk__in=[j.pk for j in jobs], state=State.SUCCEEDED).count()
            == len(jobs)
        ),
        timeout=60,
    )
    wait_until(procs, "the queue to empty", lambda: not OrmQ.objects.exists(), timeout=20)
    attempts = list(Attempt.objects.filter(job__in=jobs))
    assert Counter(a.outcome for a in attempts) == {Outcome.SUCCEEDED: len(jobs)}
    by_cluster = Counter(procs.owner_of(int(a.worker.rsplit(":", 2)[1])).name for a in attempts)
    print(f"\n40 jobs in one commit, one delivery each: {dict(by_cluster)}")
    assert set(by_cluster) == {"qcluster-a", "qcluster-b"}, by_cluster
    for j in jobs:
        _one_outcome(j, user)


def test_broker__terminated_listener_reconnects_and_loses_nothing(
    procs, pg_broker, django_user_model
):
    user = django_user_model.objects.create_user(username="broker-listener")
    with _admin() as admin:
        _start_cluster(procs, "qcluster", _env(), admin, user, 1)
        [old] = _listeners(admin)
        admin.execute("SELECT pg_terminate_backend(%s)", [old])
        cut = time.monotonic()
        during, at = _request(user, 2)  # enqueued while nobody may listen
        lost_ms = _latency_ms(procs, during, at)
        wait_until(
            procs,
            "a new listener",
            lambda: [p for p in _listeners(admin) if p != old],
            timeout=5,
            interval=0.02,
        )
        back = time.monotonic() - cut
        after = []
        for k in range(5):
            time.sleep(0.3)
            job, at = _request(user, 10 + k)
            after.append(_latency_ms(procs, job, at))
    print(
        f"\nlistener {old} terminated: a job enqueued then succeeded after {lost_ms:.0f} ms; "
        f"listening again after {back * 1000:.0f} ms; then (ms) "
        + " ".join(f"{v:.0f}" for v in after)
    )
    assert back < 5
    assert statistics.median(after) < 100 and max(after) < 1000, after
    assert Job.objects.exclude(state=State.SUCCEEDED).count() == 0
    _one_outcome(during, user)


def test_broker__database_gone_under_running_workers_loses_nothing(
    procs, pg_broker, django_user_model
):
    """The relay cuts every connection of the cluster and refuses new ones for 3 s (what a
    restart of the server does to its clients); jobs running, queued and enqueued during
    the outage all end exactly once, and the cluster listens again."""
    user = django_user_model.objects.create_user(username="broker-restart")
    relay = DatabaseProxy(*database_address()).start()
    try:
        with _admin() as admin:
            env = _env(port=relay.port, TEST_Q_WORKERS="2")
            _start_cluster(procs, "qcluster", env, admin, user, 1)
            procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.5", env=env)
            jobs = [_request(user, 10 + k, **LONG_JOB)[0] for k in range(2)]
            jobs += [_request(user, 20 + k)[0] for k in range(6)]
            wait_until(
                procs,
                "a job running",
                lambda: Attempt.objects.filter(outcome="").exists(),
                timeout=30,
                interval=0.02,
            )
            relay.down()
            jobs += [_request(user, 30 + k)[0] for k in range(4)]
            time.sleep(3)
            relay.up()
            healed = time.monotonic()
            wait_until(
                procs,
                "every job to succeed",
                lambda: (
                    Job.objects.filter(pk__in=[j.pk for j in jobs], state=State.SUCCEEDED).count()
                    == len(jobs)
                ),
                timeout=90,
            )
            done = time.monotonic() - healed
            wait_until(procs, "the listener back", lambda: _listeners(admin), timeout=10)
            job, at = _request(user, 99)
            latency = _latency_ms(procs, job, at)
        wait_until(procs, "the queue to empty", lambda: not OrmQ.objects.exists(), timeout=30)
    finally:
        procs.stop_all()
        relay.close()
    print(
        f"\n{len(jobs)} jobs across a 3 s outage ({relay.cut} connections cut): all succeeded "
        f"{done:.1f} s after the database came back; then a job in {latency:.0f} ms"
    )
    for j in jobs:
        _one_outcome(j, user)
    assert latency < 1000


def _transactions(admin: psycopg.Connection) -> int:
    row = admin.execute(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
        [connection.settings_dict["NAME"]],
    ).fetchone()
    return row[0]


def _idle_rate(
    procs,
    admin,
    env,
    user,
    revision: int,
    name: str,
    window: float,
    *,
    settle: float,
    bar: float | None = None,
) -> list[float]:
    """Transactions a second at the server over ``window``; above ``bar``, one more window
    (the server counts every session of the database: a worker of autovacuum or a late
    flush of statistics on a loaded host lands in one window, a cluster's own rate in
    both). Returns the rate of each window."""
    cluster = _start_cluster(procs, name, env, admin, user, revision)
    connection.close()  # this process's own session stays out of the count
    time.sleep(settle)  # past the cluster's start-up (each process's first connection)
    rates: list[float] = []
    while len(rates) < 2:
        before = _transactions(admin)
        time.sleep(window)
        rates.append((_transactions(admin) - before) / window)
        if bar is None or rates[-1] <= bar:
            break
    procs.terminate(cluster)
    return rates


@pytest.mark.drill
def test_broker__idle_cluster_sends_at_most_one_query_a_second(procs, pg_broker, django_user_model):
    """Counted at the server: the database's transactions (each statement of the pusher is
    one) while the cluster has no work to do, on this broker with its default heartbeat
    (5 s) over a minute, which holds one run of the site's dispatcher schedule (once a
    minute, as in production), and on the ORM claiming broker (poll 0.1 s)."""
    user = django_user_model.objects.create_user(username="broker-quiet")
    # The schedule was due since the database was made: due in 40 s instead, so that the
    # window (about 23-83 s after the start; the sentinel looks at schedules every 30 s)
    # holds one run of it, at 60 s, as every minute of a long-running cluster does.
    Schedule.objects.filter(name="jobs.dispatch").update(
        next_run=timezone.now() + timedelta(seconds=40)
    )
    ours_env = _env()
    ours_env.pop("Q_BROKER_HEARTBEAT")
    # Autovacuum's transactions count at the server too: after the tests that ran before
    # on this database (CI), a worker vacuuming its tables in the window read as 1.2 and
    # 2.8 transactions a second. Vacuumed and analyzed now, nothing is left for it to do.
    with psycopg.connect(url_from_settings(connection.settings_dict), autocommit=True) as db:
        db.execute("VACUUM ANALYZE")
    with _admin() as admin:
        windows = _idle_rate(
            procs, admin, ours_env, user, 1, "qcluster-broker", 60.0, settle=20, bar=1.0
        )
        orm_env = _env(broker=False)
        [orm] = _idle_rate(procs, admin, orm_env, user, 2, "qcluster-orm", 15.0, settle=5)
    print(
        "\nidle cluster, transactions per second at the server: claiming broker "
        f"{' then '.join(f'{r:.2f}' for r in windows)} (60 s each, dispatcher schedule "
        f"included), ORM claiming broker (poll 0.1 s) {orm:.2f} (15 s)"
    )
    assert orm > 3, f"the measurement saw no polling at all ({orm:.2f}/s)"
    assert min(windows) <= 1.0, windows
