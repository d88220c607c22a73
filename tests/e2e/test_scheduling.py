"""Priorities and queues with real worker processes on PostgreSQL (docs/app/scheduling.md).

One ``qcluster`` with one worker process: 50 low-priority jobs queued, then one high:
the high one is among the first two claims; then a low job behind a stream of high
ones starts once it has waited past the bound (time travel: its due time moves back).
Two ``jobs_worker --queue`` processes: a ``reports`` job is never run by the
``default`` worker, ``default`` work flows with the ``reports`` worker stopped, and
``queue:reports`` concurrency 1 holds at every instant (the attempts' start and end
times, by the server's clock, never overlap). Waits are conditions with generous
deadlines; nothing asserts a duration.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from django.db import transaction
from django.db.models import F
from django.db.models.functions import Now

import jobs
from jobs import flow, rules
from jobs.models import Attempt, Job
from jobs.testing.processes import proc_stat
from tests.e2e.processes import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.postgres]

KIND = "test.steps"  # tests.testapp.kinds: an artifact, optional heartbeated stages


def ask(name: str, *, priority: int = 0, queue: str = "default", **params) -> Job:
    handle = jobs.request(KIND, ("scheduling", name), priority=priority, queue=queue, params=params)
    assert handle.created
    return handle.job


def claims(job_ids=None) -> list[Attempt]:
    """Attempts that ran a job (not the deliveries that only recorded a verdict)."""
    rows = Attempt.objects.filter(number__gt=0, job__kind=KIND)
    if job_ids is not None:
        rows = rows.filter(job_id__in=job_ids)
    return list(rows.order_by("started_at", "id"))


def done(ids) -> bool:
    return Job.objects.filter(pk__in=ids, state=Job.State.SUCCEEDED).count() == len(ids)


def test_priority_with_one_real_worker__first_claims_and_the_starvation_bound(procs):
    low = [ask(f"low-{i}", priority=-10).pk for i in range(50)]
    high = ask("high", priority=10).pk
    procs.env.update(TEST_Q_WORKERS="1")
    procs.start("qcluster", "qcluster")
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.2")
    wait_until(procs, "all 51 jobs to succeed", lambda: done([*low, high]), timeout=120)
    order = [a.job_id for a in claims([*low, high])]
    print(f"claim order: high at position {order.index(high) + 1} of {len(order)}")
    assert order.index(high) < 2, order[:5]
    assert sorted(order) == sorted([*low, high]), "each job ran once"

    # Starvation: one low job behind a backlog of high ones. It waits while they run;
    # once it has waited past the bound (11 levels at the default 60 s: moved back 13
    # levels here) it is claimed next, ahead of the high jobs still waiting.
    # One commit for the low job and the stream: an idle worker handed the low job's
    # message before the stream existed would rightly run it at once (seen on a loaded run).
    with transaction.atomic():
        starved = ask("starved", priority=0).pk
        stream = [ask(f"stream-{i}", priority=10, stages=1, stage_sleep=0.2).pk for i in range(30)]
    wait_until(
        procs,
        "five of the stream to succeed",
        lambda: Job.objects.filter(pk__in=stream, state=Job.State.SUCCEEDED).count() >= 5,
        timeout=60,
    )
    assert Job.objects.get(pk=starved).attempts == 0, "priority still counts before the bound"
    waited = timedelta(seconds=13 * rules.aging_seconds())
    travelled = Job.objects.filter(pk=starved, state=Job.State.QUEUED).update(
        next_attempt_at=F("next_attempt_at") - waited
    )
    assert travelled == 1
    moved_at = Job.objects.annotate(t=Now()).values_list("t", flat=True).get(pk=starved)
    wait_until(procs, "the rest to run", lambda: done([starved, *stream]), timeout=90)
    (its,) = claims([starved])
    after = [a for a in claims(stream) if a.started_at >= its.started_at]
    before = [a for a in claims(stream) if moved_at <= a.started_at < its.started_at]
    print(f"stream claims after the travel, before it: {len(before)}; after it: {len(after)}")
    assert len(before) <= 2, "claimed within the next two deliveries once past the bound"
    assert len(after) >= 10, "it went ahead of the high jobs still waiting"


def _descends_from(pid: int, root: int) -> bool:
    """Whether process ``pid`` is ``root`` or one of its descendants (alive now)."""
    for _ in range(20):
        if pid == root:
            return True
        stat = proc_stat(pid)
        if stat is None:
            return False
        pid = int(stat[1])  # ppid, the field after the state
        if pid <= 1:
            return False
    return False


def test_two_workers_on_different_queues(procs):
    flow.set_rule(rules.queue_scope("reports"), actor="test", concurrency=1)
    work = {"stages": 2, "stage_sleep": 0.1}
    reports = [ask(f"report-{i}", queue="reports", **work).pk for i in range(6)]
    plain = [ask(f"plain-{i}", **work).pk for i in range(6)]
    procs.env.update(TEST_Q_WORKERS="3")  # three workers each: the rule, not the size, binds
    reports_worker = procs.start("reports-worker", "jobs_worker", "--queue", "reports")
    default_worker = procs.start("default-worker", "jobs_worker", "--queue", "default")
    # A deferred job's next message comes from the dispatcher, on the job's own queue.
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.2")
    wait_until(procs, "every job to succeed", lambda: done([*reports, *plain]), timeout=120)

    ran_reports = {int(a.worker.split(":")[1]) for a in claims(reports)}
    ran_plain = {int(a.worker.split(":")[1]) for a in claims(plain)}
    print(f"reports ran in worker pids {ran_reports}, default in {ran_plain}")
    assert all(_descends_from(pid, reports_worker.pid) for pid in ran_reports), ran_reports
    assert all(_descends_from(pid, default_worker.pid) for pid in ran_plain), ran_plain

    # queue:reports at 1: no two reports attempts overlap (server clock, start to end).
    spans = [(a.started_at, a.finished_at) for a in claims(reports)]
    assert all(end is not None for _, end in spans)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, f"two reports attempts overlapped: {spans}"
    looks = Job.objects.filter(pk__in=reports).values_list("held_looks", flat=True)
    print(f"reports claims held back by queue:reports (held looks): {sum(looks)}")

    # The reports worker stopped: default work still flows, reports work waits for it.
    procs.terminate(reports_worker)
    waiting = [ask(f"report-late-{i}", queue="reports").pk for i in range(2)]
    flowing = [ask(f"plain-late-{i}").pk for i in range(4)]
    wait_until(procs, "default work to flow", lambda: done(flowing), timeout=60)
    assert Job.objects.filter(pk__in=waiting, state=Job.State.QUEUED, attempts=0).count() == 2
    assert not Attempt.objects.filter(job_id__in=waiting).exists(), "no delivery touched them"
