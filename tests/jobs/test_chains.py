"""Chains and groups (docs/app/chains.md): follow-ups exist exactly when their parent
succeeded, once; a group's join is requested once, when the last child ended, by a CAS
on the group's counter (never by polling); a child that did not succeed makes the join
follow its kind's rule; cancelling a finished parent cancels its follow-ups not running.

Deliveries run in this process (``run_delivery``); a stale worker is made as in
test_steps.py: inside its handler the test expires its lease and lets another worker
take and finish the job. Concurrent ends of a group's children run on PostgreSQL in
real threads."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from django.db import connection

import jobs
from jobs import rules
from jobs.delivery.runner import claim_for, run_delivery
from jobs.dispatch import dispatch_once
from jobs.engine import groups
from jobs.models import Attempt, Job, JobGroup
from jobs.registry import kinds, register_kind
from tests.jobs.helpers import engine_messages, expire_lease, request_job, run_job

pytestmark = pytest.mark.django_db(transaction=True)

RAN: Counter = Counter()  # job id -> handler runs
JOINED: dict[int, list] = {}  # join job id -> what ctx.joined() returned
INSIDE: dict[str, callable] = {}  # subject -> what the test does inside the parent's handler


def _parent(ctx):
    RAN[ctx.job.pk] += 1
    if ctx.job.subject_id in INSIDE:
        INSIDE.pop(ctx.job.subject_id)(ctx)
    shape = ctx.params.get("shape", "group")
    if shape == "chain":
        return [jobs.then("test.chain_child", params={"n": 1}, name="next")]
    if shape == "bad_kind":
        return [jobs.then("test.no_such_kind")]
    if shape == "same_names":
        return [jobs.then("test.chain_child", name="x"), jobs.then("test.chain_child", name="x")]
    modes = ctx.params.get("modes", ["ok", "ok", "ok"])
    children = [
        jobs.then("test.chain_child", params={"n": i, "mode": mode}, name=f"part-{i}")
        for i, mode in enumerate(modes)
    ]
    join = jobs.then(ctx.params.get("join", "test.chain_join"), params={"office": 7})
    return [jobs.group(children, join=join, name="parts")]


def _child(ctx):
    RAN[ctx.job.pk] += 1
    if ctx.params.get("mode") == "fail":
        raise jobs.PayloadInvalid("the test's child cannot be done")
    if ctx.params.get("mode") == "big":
        return [jobs.result("x" * (40 * 1024))]
    return [jobs.result({"n": ctx.params.get("n"), "pages": 2})]


def _join(ctx):
    RAN[ctx.job.pk] += 1
    JOINED[ctx.job.pk] = ctx.joined()
    pages = sum(c.result["pages"] for c in JOINED[ctx.job.pk] if c.result)
    return [jobs.result({"pages": pages})]


if "test.chain_parent" not in kinds():
    register_kind("test.chain_parent", _parent, max_attempts=3)
    register_kind("test.chain_child", _child, max_attempts=2)
    register_kind("test.chain_join", _join)  # on_child_failure="fail", the default
    register_kind("test.chain_join_skip", _join, on_child_failure="skip")
    register_kind("test.chain_join_run", _join, on_child_failure="run")


@pytest.fixture(autouse=True)
def _fresh():
    RAN.clear()
    JOINED.clear()
    INSIDE.clear()


def parent(subject: str, **params) -> Job:
    job, _ = request_job(
        "test.chain_parent", subject_type="test", subject_id=subject, params=params
    )
    return job


def claimable_now(job_ids) -> set[int]:
    """Which of ``job_ids`` a claim may take now (their rows are the queue: waiting, due,
    not held, budget left); and no engine job has a ``django_q_ormq`` row."""
    assert engine_messages() == []
    due = Job.objects.filter(rules.to_q(rules.CLAIMABLE), pk__in=job_ids)
    return set(due.values_list("pk", flat=True))


def children_of(job: Job) -> list[Job]:
    return list(Job.objects.filter(parent=job).order_by("pk"))


def test_then__the_follow_up_exists_once_when_the_parent_succeeded():
    job = parent("chain", shape="chain")
    assert children_of(job) == []  # nothing is requested before the publish
    assert run_delivery(job.pk, worker="w-1").outcome == Attempt.Outcome.SUCCEEDED
    (child,) = children_of(job)
    assert (child.kind, child.subject_type, child.subject_id) == (
        "test.chain_child",
        "jobs.job",
        f"{job.pk}.next",
    )
    assert child.state == Job.State.QUEUED and child.params == {"n": 1}
    assert claimable_now({child.pk}) == {child.pk}  # due on its row, committed with it
    # A redelivery of the finished parent: it requests nothing more, and runs nothing else
    # (a named claim takes exactly the job it names).
    assert run_delivery(job.pk, worker="w-2").outcome == "duplicate"
    assert len(children_of(job)) == 1
    child.refresh_from_db()
    assert child.state == Job.State.QUEUED
    assert run_job(child.pk).outcome == Attempt.Outcome.SUCCEEDED
    assert RAN[child.pk] == 1
    assert jobs.JobHandle(child).result == {"n": 1, "pages": 2}


def test_then__a_stale_parent_requests_nothing_and_the_winner_requests_once(settings):
    """Worker A's lease runs out inside the handler; B claims and publishes (its follow-up
    is written); A returns the same follow-up: its publish is refused, nothing added."""
    settings.JOBS_LEASE_SECONDS = 30
    job = parent("stale", shape="chain")
    seen = {}

    def take_over(ctx_a):
        expire_lease(Job.objects.get(pk=ctx_a.job.pk))
        seen["b"] = run_delivery(ctx_a.job.pk, worker="w-B")

    INSIDE["stale"] = take_over
    a = run_delivery(job.pk, worker="w-A")
    assert seen["b"].outcome == Attempt.Outcome.SUCCEEDED
    assert a.outcome == Attempt.Outcome.LEASE_LOST
    assert RAN[job.pk] == 2
    (child,) = children_of(job)
    assert claimable_now({child.pk}) == {child.pk}


def test_group__the_join_is_requested_once_when_the_last_child_ended_and_reads_results():
    job = parent("group")
    run_delivery(job.pk, worker="w-1")
    group = JobGroup.objects.get(parent=job)
    children = list(group.children.order_by("pk"))
    assert [c.subject_id.rsplit(".", 1)[1] for c in children] == ["part-0", "part-1", "part-2"]
    assert (group.size, group.ended, group.join_id) == (3, 0, None)
    for done, child in enumerate(children, start=1):
        assert run_job(child.pk).outcome == Attempt.Outcome.SUCCEEDED
        group.refresh_from_db()
        assert group.ended == done
        assert (group.join_id is not None) == (done == 3), "requested by the last end only"
    join = group.join
    assert (join.kind, join.subject_type, join.subject_id) == (
        "test.chain_join",
        "jobs.group",
        str(group.pk),
    )
    assert join.parent_id == job.pk and join.params == {"office": 7}
    assert claimable_now({join.pk}) == {join.pk}
    assert run_job(join.pk).outcome == Attempt.Outcome.SUCCEEDED
    seen = JOINED[join.pk]
    assert [(c.name, c.state, c.result) for c in seen] == [
        ("part-0", "succeeded", {"n": 0, "pages": 2}),
        ("part-1", "succeeded", {"n": 1, "pages": 2}),
        ("part-2", "succeeded", {"n": 2, "pages": 2}),
    ]
    assert jobs.JobHandle(join).result == {"pages": 6}
    assert Job.objects.filter(subject_type="jobs.group").count() == 1
    assert dispatch_once()["group_ends"] == 0  # every end was counted by its arrow


@pytest.mark.parametrize(
    ("join_kind", "state"),
    [
        ("test.chain_join", Job.State.FAILED),
        ("test.chain_join_skip", Job.State.CANCELLED),
        ("test.chain_join_run", Job.State.SUCCEEDED),
    ],
    ids=["fail", "skip", "run"],
)
def test_group__a_child_that_did_not_succeed_makes_the_join_follow_its_kinds_rule(join_kind, state):
    job = parent(f"rule-{join_kind}", modes=["ok", "fail", "ok"], join=join_kind)
    run_delivery(job.pk, worker="w-1")
    group = JobGroup.objects.get(parent=job)
    outcomes = [run_job(c.pk).outcome for c in group.children.order_by("pk")]
    assert outcomes == ["succeeded", "failed", "succeeded"]
    group.refresh_from_db()
    assert (group.ended, group.not_succeeded) == (3, 1)
    join = group.join
    if state != Job.State.SUCCEEDED:
        assert join.state == state, "born final: it never runs"
        assert join.last_error_code == "children_failed"
        assert "1 of 3 children did not succeed (part-1 failed)" in join.last_error_detail
        assert claimable_now({join.pk}) == set()
        assert not Attempt.objects.filter(job=join).exists()
    else:
        assert run_job(join.pk).outcome == Attempt.Outcome.SUCCEEDED
        assert [(c.name, c.state) for c in JOINED[join.pk]] == [
            ("part-0", "succeeded"),
            ("part-1", "failed"),
            ("part-2", "succeeded"),
        ]
        assert JOINED[join.pk][1].result is None
        assert jobs.JobHandle(join).result == {"pages": 4}


def test_group__a_child_whose_budget_is_spent_counts_as_dead():
    job = parent("spent")
    run_delivery(job.pk, worker="w-1")
    group = JobGroup.objects.get(parent=job)
    first, *rest = group.children.order_by("pk")
    Job.objects.filter(pk=first.pk).update(attempts=2)  # two crashed claims, say
    assert run_delivery(first.pk, worker="w-2").outcome == "buried"
    for child in rest:
        run_job(child.pk)
    group.refresh_from_db()
    assert group.join.state == Job.State.FAILED
    assert "part-0 dead" in group.join.last_error_detail


@pytest.mark.postgres
def test_group__children_ending_at_once_in_threads_request_one_join():
    """Twelve children publish concurrently, each in its own thread and connection: the
    group's counter takes every end once and exactly one transaction requests the join."""
    job = parent("threads", modes=["ok"] * 12)
    run_delivery(job.pk, worker="w-1")
    group = JobGroup.objects.get(parent=job)
    ids = list(group.children.values_list("pk", flat=True))
    start = threading.Barrier(len(ids))
    outcomes = {}

    def finish(pk: int) -> None:
        try:
            start.wait(10)
            outcomes[pk] = run_delivery(pk, worker=f"w-{pk}").outcome
        finally:
            connection.close()

    threads = [threading.Thread(target=finish, args=(pk,)) for pk in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    # Each delivery took the child it named: every child ran exactly once.
    assert Job.objects.filter(pk__in=ids, state=Job.State.SUCCEEDED).count() == 12
    leftover = [pk for pk in ids if Attempt.objects.filter(job_id=pk, number=1).count() != 1]
    assert leftover == []
    group.refresh_from_db()
    assert (group.ended, group.not_succeeded, group.version) == (12, 0, 12)
    assert Job.objects.filter(subject_type="jobs.group", subject_id=str(group.pk)).count() == 1
    assert claimable_now({group.join_id}) == {group.join_id}


def test_cancel__a_finished_parent_cancels_its_follow_ups_not_running_and_its_join():
    job = parent("cancel")
    run_delivery(job.pk, worker="w-1")
    group = JobGroup.objects.get(parent=job)
    first, second, third = group.children.order_by("pk")
    assert run_job(first.pk).outcome == Attempt.Outcome.SUCCEEDED
    assert claim_for(second.pk, "w-2").won  # running when the cancel comes
    assert jobs.cancel(job.pk, actor="operator:ana") == "follow_ups_cancelled"
    states = dict(Job.objects.filter(group=group).values_list("pk", "state"))
    assert states == {first.pk: "succeeded", second.pk: "running", third.pk: "cancelled"}
    group.refresh_from_db()
    assert group.cancelled_at is not None and group.join_id is None
    assert jobs.cancel(job.pk) == "already_finished"  # nothing more to cancel
    # The running child finishes; its end is the last: the join is born cancelled.
    Job.objects.filter(pk=second.pk).update(state=Job.State.SUCCEEDED)  # as its publish
    assert dispatch_once()["group_ends"] == 1  # the operator's edit, counted by the sweep
    group.refresh_from_db()
    assert group.join.state == Job.State.CANCELLED
    assert group.join.last_error_detail.startswith("the parent job was cancelled")


def test_sweep__an_end_written_outside_the_engine_is_counted_once():
    job = parent("sweep", modes=["ok"])
    run_delivery(job.pk, worker="w-1")
    (child,) = JobGroup.objects.get(parent=job).children.all()
    Job.objects.filter(pk=child.pk).update(state=Job.State.FAILED)  # an operator's edit
    assert groups.sweep() == 1
    assert groups.sweep() == 0
    group = JobGroup.objects.get(parent=job)
    assert (group.ended, group.join.state) == (1, Job.State.FAILED)


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        ("bad_kind", "job kind 'test.no_such_kind' is not registered"),
        ("same_names", "two have the name 'x'"),
    ],
)
def test_then__a_bad_follow_up_fails_the_parent_once_with_a_reason_and_requests_nothing(
    shape, reason
):
    job = parent(f"bad-{shape}", shape=shape)
    assert run_delivery(job.pk, worker="w-1").outcome == Attempt.Outcome.FAILED
    job.refresh_from_db()
    assert job.last_error_class == "validation" and reason in job.last_error_detail
    assert children_of(job) == [] and RAN[job.pk] == 1


def test_result__too_large_fails_once_with_its_size_and_no_value():
    job = parent("big", modes=["big"])
    run_delivery(job.pk, worker="w-1")
    (child,) = children_of(job)
    assert run_job(child.pk).outcome == Attempt.Outcome.FAILED
    child.refresh_from_db()
    assert "at most 32768 bytes of JSON" in child.last_error_detail
    assert "xxxx" not in child.last_error_detail and child.result is None


def test_publish__a_plan_with_follow_ups_or_a_groups_child_is_the_orm_transactions():
    """The one-statement publish gives way: the follow-ups and the group's count commit
    in the ORM executor's transaction, with the fence."""
    from jobs.delivery import publish
    from jobs.registry import validate_output

    job = parent("plan")
    out = validate_output([jobs.then("test.chain_child")])
    attempt = Attempt(job=job, number=1)
    plan = publish.build(job, "w", attempt, None, out)
    assert plan.statement_refusal() == "follow-up jobs"
    job.group_id = 1
    plan = publish.build(job, "w", attempt, None, validate_output([]))
    assert plan.statement_refusal() == "a group's child: its end is counted in the group"
    job.group_id = None
    plan = publish.build(job, "w", attempt, None, validate_output([jobs.result(1)]))
    assert plan.statement_refusal() == "a result value"
    assert publish.build(job, "w", attempt, None, validate_output([])).statement_refusal() == ""


def test_job_page__shows_where_a_job_stands_in_its_chain(admin_client):
    job = parent("page", modes=["ok", "fail"])
    run_delivery(job.pk, worker="w-1")
    group = JobGroup.objects.get(parent=job)
    first, second = group.children.order_by("pk")
    run_job(first.pk)

    page = admin_client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert "Follow-ups (requested when this job succeeded)" in page
    assert "<label>Chain:</label>" in page
    assert (
        "requested group parts: 1 of 2 ended, 0 did not succeed; its join: not requested yet"
        in (page)
    )
    child = admin_client.get(f"/admin/jobs/job/{second.pk}/change/").content.decode()
    assert f'requested by <a href="/admin/jobs/job/{job.pk}/change/">job {job.pk}</a>' in child
    assert "child of group parts (1 of 2 ended; this one not ended yet)" in child
    assert f"jobs.job:{job.pk}.parts.part-1 r1" in child  # its subject, not a link
    assert "Fix the subject" not in child

    run_job(second.pk)
    group.refresh_from_db()
    join = admin_client.get(f"/admin/jobs/job/{group.join_id}/change/").content.decode()
    assert "the join of group parts: 2 children, 1 did not succeed" in join
    assert "1 of 2 children did not succeed (part-1 failed)" in join  # its error, shown
    plain = jobs.request("test.chain_child", ("test", "alone")).job
    alone = admin_client.get(f"/admin/jobs/job/{plain.pk}/change/").content.decode()
    assert "Follow-ups (" not in alone and "<label>Chain:</label>" not in alone


def test_admin__cancel_follow_ups_on_the_parents_page_when_one_is_waiting(admin_client):
    job = parent("admin-cancel")
    run_delivery(job.pk, worker="w-1")
    first, second, third = JobGroup.objects.get(parent=job).children.order_by("pk")
    assert run_job(first.pk).outcome == Attempt.Outcome.SUCCEEDED
    page = admin_client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    url = f"/admin/jobs/job/{job.pk}/operate/cancel_follow_ups/"
    assert 'id="operate-cancel_follow_ups"' in page and f'href="{url}"' in page
    assert "operate-requeue" not in page
    confirm = admin_client.get(url).content.decode()
    assert "Stop the jobs it requested that are not running" in confirm
    admin_client.post(url)
    states = dict(Job.objects.filter(group__parent=job).values_list("pk", "state"))
    assert states == {first.pk: "succeeded", second.pk: "cancelled", third.pk: "cancelled"}
    assert JobGroup.objects.get(parent=job).join.state == Job.State.CANCELLED
    again = admin_client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert "operate-cancel_follow_ups" not in again  # nothing is waiting any more
    refused = admin_client.get(url).content.decode()
    assert "none of its follow-ups is waiting to run" in refused
    child_page = admin_client.get(f"/admin/jobs/job/{second.pk}/change/").content.decode()
    assert f"its parent job {job.pk} was cancelled" in child_page  # its history row
