"""The PostgreSQL broker behind a real PgBouncer (Debian's ``pgbouncer`` on loopback).

In transaction mode a LISTEN's server connection goes back to the pool after the
statement: its own notifications still come back to it, nobody else's do. The broker
trusts a listener only after it hears a probe sent from its other connection, so there
it does not trust it: it logs that it polls, and every job is still picked up (by the
poll). In session mode the listener hears, and an idle cluster picks jobs up within
tens of ms with ``poll`` at 5 s.
"""

from __future__ import annotations

import statistics
import time

import pytest
from django.db import transaction
from django.utils import timezone
from django_q.conf import Conf

from jobs.models import Job
from tests.e2e.processes import request_steps_job, subprocess_env, wait_until
from tests.e2e.test_pgbouncer import running_pgbouncer

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

DEAF = "the listener hears no other session"


@pytest.fixture
def pg_broker(monkeypatch):
    monkeypatch.setattr(Conf, "BROKER_CLASS", "jobs.claiming.ClaimingBroker")


def _env(port: int, poll: str) -> dict[str, str]:
    return {
        **subprocess_env(port=port),
        "DJANGO_SETTINGS_MODULE": "tests.broker_settings",
        "JOBS_PREPARED_STATEMENTS": "0",
        "Q_POLL": poll,
    }


def _pickups(procs, user, revisions: range) -> list[float]:
    values = []
    for revision in revisions:
        time.sleep(0.3)
        with transaction.atomic():
            job = request_steps_job(user, revision, tenant_key="pooled")
        at = timezone.now()
        wait_until(
            procs,
            f"job {job.pk} to succeed",
            lambda job=job: Job.objects.filter(pk=job.pk, state=Job.State.SUCCEEDED).exists(),
            timeout=30,
            interval=0.005,
        )
        job.refresh_from_db()
        values.append((job.finished_at - at).total_seconds() * 1000)
    return values


def test_broker_pgbouncer__transaction_pool_polls_and_loses_nothing(
    procs, pg_broker, django_user_model
):
    user = django_user_model.objects.create_user(username="pooled-broker")
    with running_pgbouncer("transaction", 4) as (port, _folder):
        cluster = procs.start("qcluster", "qcluster", env=_env(port, "0.2"))
        wait_until(
            procs,
            "the broker to say it polls",
            lambda: DEAF in cluster.log_path.read_text(errors="replace"),
            timeout=60,
        )
        values = _pickups(procs, user, range(1, 6))
        procs.terminate(cluster)
    print(f"\ntransaction pool: polled pickups (ms) {' '.join(f'{v:.0f}' for v in values)}")
    assert "listening on" not in cluster.log_path.read_text(errors="replace")


def test_broker_pgbouncer__session_pool_listens(procs, pg_broker, django_user_model):
    user = django_user_model.objects.create_user(username="session-broker")
    with running_pgbouncer("session", 6) as (port, _folder):
        cluster = procs.start("qcluster", "qcluster", env=_env(port, "5"))
        wait_until(
            procs,
            "the broker to listen",
            lambda: "listening on" in cluster.log_path.read_text(errors="replace"),
            timeout=60,
        )
        values = _pickups(procs, user, range(1, 7))
        procs.terminate(cluster)
    print(f"\nsession pool: pickups (ms) {' '.join(f'{v:.0f}' for v in values)} (poll 5 s)")
    assert DEAF not in cluster.log_path.read_text(errors="replace")
    assert statistics.median(values) < 100 and max(values) < 1000, values
