"""Several hosts (issue 23): identities carry the host; dispatchers need no leader.

Dispatchers on every host sweep at once, each on its own connection (threads here,
processes in ``make scaleout``): every due job and every expired lease still gets
exactly one message, because each message is guarded by the conditional UPDATE of
``enqueued_for`` in the transaction that enqueues it.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from django.db import connections
from django.db.models.functions import Now
from django_q.models import OrmQ

from jobs import conf
from jobs.dispatch import dispatch_once
from jobs.engine import job_machine
from jobs.models import Job
from tests.jobs.helpers import expire_lease, new_job

# These promises are about queue messages (jobs.queue, jobs.bulk, jobs.dispatch).
pytestmark = pytest.mark.usefixtures("message_broker")


def test_worker_identity__carries_the_configured_host_name(settings, monkeypatch):
    settings.JOBS_HOST_NAME = "host-b"
    monkeypatch.setattr(job_machine, "_identity", None)
    assert job_machine.worker_identity().startswith("host-b:")
    settings.JOBS_HOST_NAME = ""
    monkeypatch.setattr(job_machine, "_identity", None)
    import socket

    assert job_machine.worker_identity().startswith(f"{socket.gethostname()}:")
    assert conf.host_name() == socket.gethostname()


def _job_messages() -> Counter:
    out: Counter = Counter()
    for message in OrmQ.objects.all():
        task = message.task
        if task["func"] == "jobs.tasks.run_job":
            out[task["args"][0]] += 1
    return out


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_dispatchers__on_every_host_at_once__one_message_per_due_job():
    due = [new_job(kind="test.steps", subject=1000 + i) for i in range(40)]
    expired = due[:15]
    Job.objects.filter(pk__in=[j.pk for j in expired]).update(
        state=Job.State.RUNNING, lease_owner="host-a:1:dead", lease_expires_at=Now()
    )
    for job in expired:
        expire_lease(job)
    Job.objects.filter(pk__in=[j.pk for j in due[15:]]).update(next_attempt_at=Now())
    OrmQ.objects.all().delete()  # the messages of the requests: the dispatchers start cold

    start = threading.Barrier(3)
    sent: list[dict] = []

    def dispatcher():
        try:
            start.wait(10)
            for _ in range(3):
                sent.append(dispatch_once())
        finally:
            connections.close_all()

    threads = [threading.Thread(target=dispatcher) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    messages = _job_messages()
    assert sorted(messages) == sorted(j.pk for j in due), "every due job got a message"
    assert set(messages.values()) == {1}, "and only one, whichever dispatcher sent it"
    assert sum(s["due_jobs"] + s["expired_leases"] for s in sent) == len(due)


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
def test_check_broker_pooler__the_postgres_brokers_listen_through_a_pooler_warns(
    settings, monkeypatch
):
    from django.db import connection

    from jobs.checks import check_broker_pooler

    broker = {**settings.Q_CLUSTER, "broker_class": "jobs.broker.PostgresBroker"}
    settings.Q_CLUSTER = broker
    assert check_broker_pooler(databases=["default"]) == [], "direct to PostgreSQL: silent"
    connection.ensure_connection()
    monkeypatch.setitem(connection.settings_dict, "PORT", "6432")
    (warning,) = check_broker_pooler(databases=["default"])
    assert warning.id == "jobs.W019" and "6432" in warning.msg and "poll" in warning.msg
    settings.Q_CLUSTER = {**broker, "broker_listen": False}
    assert check_broker_pooler(databases=["default"]) == [], "told to poll: nothing to say"
    settings.Q_CLUSTER = {k: v for k, v in broker.items() if k != "broker_class"}
    assert check_broker_pooler(databases=["default"]) == [], "the ORM broker polls anyway"
