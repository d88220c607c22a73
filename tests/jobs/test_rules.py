"""Each fence is written once (``jobs.rules``); its three renderings must agree.

The same rows are judged by the ORM (``to_q``), by SQL text (``to_sql``, what the
statements embed) and in Python (``holds``, what the ORM claim asks of a row it
read); the tenant function's frozen text must be what the rule generates now.
"""

from __future__ import annotations

import importlib
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now

from jobs import rules
from jobs.models import Job
from tests.jobs.helpers import advisory_lock_held

pytestmark = pytest.mark.django_db

S = Job.State


def _jobs() -> list[Job]:
    """Jobs on both sides of every condition: states, due times, budgets, leases."""
    now = Job.objects.annotate(db_now=Now()).values_list("db_now", flat=True).first()
    if now is None:
        Job.objects.create(kind="probe", subject_type="t", subject_id="probe")
        now = Job.objects.annotate(db_now=Now()).values_list("db_now", flat=True).first()
    past, future = now - timedelta(minutes=5), now + timedelta(minutes=5)
    rows = []
    n = 0
    for state in (S.QUEUED, S.RETRY_WAIT, S.RUNNING, S.SUCCEEDED, S.DEAD):
        for due in (None, past, future):
            for attempts, budget in ((0, 3), (3, 3)):
                for lease in (past, future):
                    n += 1
                    rows.append(
                        Job(
                            kind="rules",
                            subject_type="t",
                            subject_id=str(n),
                            state=state,
                            next_attempt_at=due,
                            attempts=attempts,
                            max_attempts=budget,
                            lease_owner="w1" if n % 2 else "w2",
                            lease_expires_at=lease if state == S.RUNNING or n % 3 else None,
                            version=n % 4,
                        )
                    )
    return Job.objects.bulk_create(rows)


RULES = {
    "live_running": (rules.LIVE_RUNNING, {}),
    "claimable": (rules.CLAIMABLE, {}),
    "waiting": (rules.WAITING, {}),
    "due": (rules.DUE, {}),
    "has_budget": (rules.HAS_BUDGET, {}),
}


@pytest.mark.parametrize("name", list(RULES))
def test_rules__orm_sql_and_python_agree_on_every_row(name):
    rule, args = RULES[name]
    jobs = _jobs()
    ids = {j.pk for j in jobs}
    by_orm = set(
        Job.objects.filter(rules.to_q(rule, **args), pk__in=ids).values_list("pk", flat=True)
    )
    rendered = rules.to_sql(rule, Job, now=_now_sql())
    with connection.cursor() as cursor:
        cursor.execute(
            f'SELECT id FROM {Job._meta.db_table} WHERE {rendered.text} AND "id" IN '
            f"({', '.join(str(i) for i in ids)})",
            rendered.params(**args),
        )
        by_sql = {row[0] for row in cursor.fetchall()}
    now = Job.objects.annotate(db_now=Now()).values_list("db_now", flat=True).first()
    by_python = {j.pk for j in Job.objects.filter(pk__in=ids) if rules.holds(rule, j, now=now)}
    assert by_orm == by_sql == by_python
    assert 0 < len(by_orm) < len(ids), "the rows fall on both sides"


@pytest.mark.postgres  # the SQL rendering of a margin is PostgreSQL's make_interval
def test_rules__owner_fence_agrees_for_each_worker_and_margin():
    jobs = _jobs()
    now = Job.objects.annotate(db_now=Now()).values_list("db_now", flat=True).first()
    for job in jobs[:12]:
        for worker in ("w1", "w2"):
            for margin in (0, 600):
                args = {"job": job.pk, "version": job.version, "worker": worker, "margin": margin}
                by_orm = Job.objects.filter(rules.to_q(rules.OWNER_FENCE, **args)).exists()
                rendered = rules.to_sql(rules.OWNER_FENCE, Job, now=_now_sql())
                with connection.cursor() as cursor:
                    cursor.execute(
                        f"SELECT 1 FROM {Job._meta.db_table} WHERE {rendered.text}",
                        rendered.params(**args),
                    )
                    by_sql = cursor.fetchone() is not None
                assert by_orm == by_sql == rules.holds(rules.OWNER_FENCE, job, now=now, **args)


def _now_sql() -> str:
    if connection.vendor == "postgresql":
        return "clock_timestamp()"
    return "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')"


def test_tenant_function__frozen_text_is_what_the_rule_generates():
    migration = importlib.import_module("jobs.migrations.0008_tenant_admits_v2")
    assert rules.tenant_function_sql() == migration.CREATE, (
        "jobs.rules changed: add a migration with jobs_tenant_admits_v3 from the new rule"
    )


def test_flow_function__frozen_text_is_what_the_rules_generate():
    migration = importlib.import_module("jobs.migrations.0014_flow_admits_v2")
    assert rules.flow_function_sql() == "\n" + migration.CREATE, (
        "jobs.rules changed: add a migration with jobs_flow_admits_v3 from the new rules"
    )


@pytest.mark.postgres
def test_tenant_function__never_waits_for_a_busy_tenant_lock():
    """Another claim of the tenant holds its lock: the function admits nothing at once."""
    import time

    with advisory_lock_held(rules.TENANT_LOCK_CLASS, "busy"), connection.cursor() as cursor:
        started = time.monotonic()
        cursor.execute("SELECT jobs_tenant_admits_v2('busy', 0, 5)")
        admitted = cursor.fetchone()[0]
        waited = time.monotonic() - started
        cursor.execute("SELECT jobs_tenant_admits_v2('idle', 0, 5)")
        idle = cursor.fetchone()[0]
    assert admitted is False and idle is True
    assert waited < 15, f"waited {waited:.2f} s behind a lock held for 30 s"


def test_flow_verdict__frozen_text_is_what_the_admission_generates():
    from jobs.engine import verdict_sql

    migration = importlib.import_module("jobs.migrations.0021_flow_verdict")
    assert verdict_sql.verdict_function_sql() == "\n" + migration.CREATE, (
        "jobs.engine.verdict_sql changed: add a migration with jobs_flow_verdict_v2"
    )
    assert verdict_sql.verdict_type_sql() == migration.TYPE
    v2 = importlib.import_module("jobs.migrations.0033_job_held_looks_deferred_by")
    assert verdict_sql.verdict_function_sql(2) == "\n" + v2.VERDICT, (
        "jobs.engine.verdict_sql changed: add a migration with jobs_flow_verdict_v3"
    )
