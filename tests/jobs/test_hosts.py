"""Several hosts (issue 23): identities carry the host; claims need no leader.

Clusters on every host claim at once, each on its own connection (threads here,
processes in ``make scaleout``): every due job and every expired lease is claimed
exactly once, from its row (``FOR UPDATE SKIP LOCKED`` and the job's CAS), and no
engine job has a ``django_q_ormq`` row.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from django.db import connections
from django.db.models.functions import Now
from django_q.models import OrmQ

from jobs import claiming, conf
from jobs.engine import job_machine
from jobs.models import Job
from tests.jobs.helpers import expire_lease, new_job


def test_worker_identity__carries_the_configured_host_name(settings, monkeypatch):
    settings.JOBS_HOST_NAME = "host-b"
    monkeypatch.setattr(job_machine, "_identity", None)
    assert job_machine.worker_identity().startswith("host-b:")
    settings.JOBS_HOST_NAME = ""
    monkeypatch.setattr(job_machine, "_identity", None)
    import socket

    assert job_machine.worker_identity().startswith(f"{socket.gethostname()}:")
    assert conf.host_name() == socket.gethostname()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_claims__on_every_host_at_once__each_due_job_and_expired_lease_claimed_once(settings):
    settings.JOBS_LEASE_SECONDS = 60  # claimed and not run: no lease runs out meanwhile
    settings.JOBS_TENANT_CONCURRENCY = 100  # one tenant's 40 jobs all start
    due = [new_job(kind="test.steps", subject=1000 + i) for i in range(40)]
    expired = due[:15]
    Job.objects.filter(pk__in=[j.pk for j in expired]).update(
        state=Job.State.RUNNING, lease_owner="host-a:1:dead", lease_expires_at=Now()
    )
    for job in expired:
        expire_lease(job)
    Job.objects.filter(pk__in=[j.pk for j in due[15:]]).update(next_attempt_at=Now())

    start = threading.Barrier(3)
    claimed: list[tuple[str, int]] = []

    def host(name: str):
        try:
            claimer = claiming.Claimer(["default"])
            start.wait(10)
            for _ in range(100):
                claim = claimer.next(name)
                if claim is None:
                    # As an idle pusher at its next due time: expired leases looked at first.
                    claimer.look_now()
                    claim = claimer.next(name)
                if claim is None:
                    break
                claimed.append((name, claim.job.pk))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=host, args=(f"host-{h}:1:w",)) for h in "bcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    counts = Counter(pk for _, pk in claimed)
    assert sorted(counts) == sorted(j.pk for j in due), "every due job was claimed"
    assert set(counts.values()) == {1}, "and only once, whichever host claimed it"
    owners = dict(Job.objects.filter(pk__in=counts).values_list("pk", "lease_owner"))
    assert owners == {pk: name for name, pk in claimed}, "by the host that claimed it"
    assert not OrmQ.objects.exists(), "no engine job has a django_q_ormq row"


@pytest.mark.postgres
@pytest.mark.django_db
def test_check_pooler__port_other_than_the_servers__warns_while_prepared_statements_on(
    settings, monkeypatch
):
    from django.db import connection

    from jobs.checks import check_pooler

    settings.JOBS_PREPARED_STATEMENTS = True
    assert check_pooler(databases=["default"]) == [], "direct to PostgreSQL: silent"
    connection.ensure_connection()
    # What a process connected to PgBouncer's port sees: the server names its own port.
    monkeypatch.setitem(connection.settings_dict, "PORT", "6432")
    (warning,) = check_pooler(databases=["default"])
    assert warning.id == "jobs.W014" and "6432" in warning.msg
    settings.JOBS_PREPARED_STATEMENTS = False
    assert check_pooler(databases=["default"]) == []


@pytest.mark.postgres
@pytest.mark.django_db
def test_check_broker_pooler__the_claiming_brokers_listen_through_a_pooler_warns(
    settings, monkeypatch
):
    from django.db import connection

    from jobs.checks import check_broker_pooler

    broker = {**settings.Q_CLUSTER, "broker_class": "jobs.claiming.ClaimingBroker"}
    settings.Q_CLUSTER = broker
    assert check_broker_pooler(databases=["default"]) == [], "direct to PostgreSQL: silent"
    connection.ensure_connection()
    monkeypatch.setitem(connection.settings_dict, "PORT", "6432")
    (warning,) = check_broker_pooler(databases=["default"])
    assert warning.id == "jobs.W019" and "6432" in warning.msg and "poll" in warning.msg
    settings.Q_CLUSTER = {**broker, "broker_listen": False}
    assert check_broker_pooler(databases=["default"]) == [], "told to poll: nothing to say"
    settings.Q_CLUSTER = {k: v for k, v in broker.items() if k != "broker_class"}
    assert check_broker_pooler(databases=["default"]) == [], "no claiming broker: not ours"
