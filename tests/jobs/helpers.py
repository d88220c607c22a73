"""Small helpers shared by the engine tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from django.db import connections
from django.utils import timezone

import jobs
from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, JobEvent, Notice
from jobs.testing.queue import run_queued_effects

__all__ = ["deliver", "request_job", "run_queued_effects"]


def request_job(
    kind: str,
    *,
    subject_type: str,
    subject_id: str | int,
    output_revision: int = 1,
    tenant_key: str = "",
    params: dict | None = None,
) -> tuple[Job, bool]:
    """The one job for (kind, subject, revision), asked through ``jobs.request`` (the one
    entry point), as the row and whether this call created it."""
    handle = jobs.request(
        kind,
        (subject_type, subject_id),
        revision=output_revision,
        tenant=tenant_key,
        params=params,
    )
    return handle.job, handle.created


def new_job(
    user=None, *, kind="test.steps", revision=1, tenant="t1", subject=None, **params
) -> Job:
    if user is not None:
        params.setdefault("recipients", [user.pk])
    job, _ = request_job(
        kind,
        subject_type="auth.user",
        subject_id=subject if subject is not None else (user.pk if user else 1),
        output_revision=revision,
        tenant_key=tenant,
        params=params,
    )
    return job


def lose_job(job: Job) -> None:
    """Delete the job and all it wrote, as a promoted standby that never received it
    (the artifact storage keeps its objects)."""
    Notice.objects.filter(effect__job=job).delete()
    EffectEvent.objects.filter(effect__job=job).delete()
    Effect.objects.filter(job=job).delete()
    Artifact.objects.filter(job=job).delete()
    Attempt.objects.filter(job=job).delete()
    JobEvent.objects.filter(job=job).delete()
    Job.objects.filter(pk=job.pk).delete()


def _travel(job: Job, field: str) -> None:
    """Make ``field`` a second past, as if time went by."""
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(**{field: now - timedelta(seconds=1)})


def make_due(job: Job) -> None:
    """Skip the backoff wait (the delay itself is asserted separately)."""
    _travel(job, "next_attempt_at")


def expire_lease(job: Job) -> None:
    _travel(job, "lease_expires_at")


class Crash(KeyboardInterrupt):
    """Stands in for a process dying: the runner lets only a signal's KeyboardInterrupt pass
    (any other BaseException, SystemExit included, is recorded as the attempt's failure)."""


def run_job(job_id: int, **kwargs):
    """One delivery of ``job_id`` by name; its result. A named claim takes exactly the job
    it names (``jobs.engine.named_claim``), never a more urgent one of its queue."""
    from jobs.delivery.runner import run_delivery

    result = run_delivery(job_id, **kwargs)
    assert result.job_id == job_id, (result.job_id, job_id)
    return result


ENGINE_TASKS = frozenset(
    {
        "jobs.tasks.run_job",
        "jobs.tasks.release_effect",
        "jobs.tasks.run_claimed",
        "jobs.tasks.release_claimed",
    }
)


def engine_messages() -> list[tuple[str, tuple]]:
    """(func, args) of every ``django_q_ormq`` row of an engine job or effect: the jobs
    table and the ledger are the queue, so a test expects this to be empty."""
    from django_q.models import OrmQ

    out = []
    for message in OrmQ.objects.order_by("id"):
        task = message.task
        if task.get("func") in ENGINE_TASKS:
            out.append((task["func"], tuple(task.get("args") or ())))
    return out


def releasable_effects(**filters) -> list[int]:
    """The effects a sender may lease now (pending or unknown and due, or sending whose
    lease ran out), by their ledger rows: the ledger is the releases' queue."""
    from jobs import rules

    due = Effect.objects.filter(rules.to_q(rules.EFFECT_RELEASABLE), **filters)
    return sorted(due.values_list("pk", flat=True))


def claim_next(queue: str = "default", worker: str = "w1", **options):
    """The next-job claim of ``queue`` for ``worker`` as a cluster's dequeue makes it
    (``jobs.claiming.claims().claim_next``): the claim, a verdict, or None."""
    from jobs import claiming, conf

    options.setdefault("lease", conf.lease_seconds())
    options.setdefault("bound", conf.tenant_concurrency())
    return claiming.claims().claim_next(queue, worker, **options)


def deliver(job_id: int, **kwargs):
    """One job delivery, then the releases its publish left due on the ledger."""
    from jobs.delivery.runner import run_delivery

    result = run_delivery(job_id, **kwargs)
    run_queued_effects()
    return result


@contextmanager
def advisory_lock_held(lock_class: int, key: str) -> Iterator[None]:
    """Another connection (a thread) holds the transaction lock (lock_class, hashtext(key))
    for the length of the block: what a concurrent claim of that scope looks like."""
    held, release = threading.Event(), threading.Event()

    def hold():
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute("BEGIN")
                cursor.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [lock_class, key])
                held.set()
                release.wait(30)
                cursor.execute("ROLLBACK")
        finally:
            connections["default"].close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10), "the lock was not taken"
        yield
    finally:
        release.set()
        holder.join(30)


def scanned_rows(plan: dict) -> list[tuple[str, str, int]]:
    """(node, relation, rows it produced) of every scan of ``jobs_job`` in a JSON plan."""
    found = []
    if plan.get("Relation Name") == "jobs_job":
        found.append((plan["Node Type"], plan.get("Index Name", ""), plan["Actual Rows"]))
    for child in plan.get("Plans", []):
        found += scanned_rows(child)
    return found


def scans_of(sql: str, params) -> list[tuple[str, str, int]]:
    """The job-table scans of ``sql`` run under EXPLAIN ANALYZE, its writes rolled back."""
    with connections["default"].cursor() as cursor:
        cursor.execute("BEGIN")
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        [[plan]] = cursor.fetchone()
        cursor.execute("ROLLBACK")
    return scanned_rows(plan["Plan"])
