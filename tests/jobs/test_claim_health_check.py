"""A worker's adoption of its claim is the task's connection check (``CONN_HEALTH_CHECKS``).

django-q2 closes obsolete connections before every task, and Django then checks the
kept one with a ``SELECT 1`` before its first query: a round trip a job. The adoption's
read (``runner.adopt``, ``clock.checked_by``) is the first query and its own check: a
connection that died while idle is found by it, dropped, and the read is sent again on
a new one, within the same task.
"""

from __future__ import annotations

import psycopg
import pytest
from django.db import OperationalError, close_old_connections, connection

from jobs import conf, executors
from jobs.delivery.runner import run_adopted
from jobs.executors import pgclaim
from jobs.models import Attempt, Job
from jobs.testing.scratchdb import url_from_settings
from tests.jobs.helpers import new_job

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def checks(monkeypatch):
    """Health checks on, as the site has them; counts Django's own check."""
    monkeypatch.setitem(connection.settings_dict, "CONN_HEALTH_CHECKS", True)
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 600)
    connection.close()
    connection.ensure_connection()
    calls = []
    usable = connection.is_usable

    def counted():
        calls.append(1)
        return usable()

    monkeypatch.setattr(connection, "is_usable", counted)
    return calls


def _claimed(job):
    """The broker's claim of ``job`` (its pusher's): what the worker's package names."""
    claim = pgclaim.claim_next(job.queue, "pusher-1", lease=30.0, bound=conf.tenant_concurrency())
    assert claim.won and claim.job.pk == job.pk
    return claim.job.pk, claim.job.lease_owner, claim.attempt.pk, claim.job.version


def _as_a_task_begins() -> None:
    """What django-q2's worker does before each task."""
    close_old_connections()
    assert connection.connection is not None and not connection.health_check_done


def test_adoption__no_select_1_before_the_read(make_user, checks):
    user = make_user()
    package = _claimed(new_job(user))
    _as_a_task_begins()

    result = run_adopted(*package)

    assert result.outcome == Attempt.Outcome.SUCCEEDED
    assert checks == [], "Django's health check ran: a round trip the adoption makes redundant"
    assert connection.health_check_done


def test_adoption__an_idle_connection_killed_is_replaced_and_the_job_runs(make_user, checks):
    user = make_user()
    job = new_job(user)
    package = _claimed(job)
    killed = connection.connection.info.backend_pid
    with psycopg.connect(url_from_settings(connection.settings_dict), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [killed])
    _as_a_task_begins()

    result = run_adopted(*package)

    assert result.outcome == Attempt.Outcome.SUCCEEDED
    assert connection.connection.info.backend_pid != killed
    job.refresh_from_db()
    assert (job.state, job.attempts) == (Job.State.SUCCEEDED, 1)
    assert Attempt.objects.filter(job=job).count() == 1


def test_adoption__an_error_on_a_live_connection_is_the_reads_own(make_user, checks, monkeypatch):
    """Only a dead connection is read again: an error the server gave (a lock timeout) on a
    connection that still answers is raised, and nothing is sent twice."""
    user = make_user()
    job = new_job(user)
    package = _claimed(job)
    _as_a_task_begins()
    sent = []

    def refused(*args, **kwargs):
        sent.append(1)
        raise OperationalError("canceling statement due to lock timeout")

    monkeypatch.setattr(executors.current(), "read_claim", refused)  # the adoption's read

    with pytest.raises(OperationalError):
        run_adopted(*package)

    assert sent == [1]
    assert checks == [1], "the connection was asked whether it still answers"
    job.refresh_from_db()
    assert (job.state, job.attempts) == (Job.State.RUNNING, 1), "the claim stands, untouched"
