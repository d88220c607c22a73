"""Flow rules: GCRA, rule resolution, claim enforcement, audit (PostgreSQL and SQLite)."""

from __future__ import annotations

import html
import itertools
import threading
import time
from collections import deque
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import jobs
from jobs import executors, flow, rules
from jobs.delivery import runner
from jobs.engine import admission
from jobs.executors import pgclaim
from jobs.models import Attempt, FlowRule, FlowRuleChange, Job
from tests.jobs.helpers import advisory_lock_held, new_job

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_rules():
    flow.forget()
    yield
    flow.forget()


# --- pure -------------------------------------------------------------------------------


def test_gcra__spacing_is_one_interval_and_no_burst_is_saved():
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    ok, tat = admission.gcra(None, t0, 0.5)
    assert ok and tat == t0 + timedelta(seconds=0.5)
    ok, due = admission.gcra(tat, t0 + timedelta(seconds=0.1), 0.5)
    assert not ok and due == tat, "a miss tells when the next start is due"
    ok, tat2 = admission.gcra(tat, tat, 0.5)
    assert ok and tat2 == tat + timedelta(seconds=0.5)
    # Idle for a minute: the next start is allowed, but no burst was saved up.
    later = tat2 + timedelta(seconds=60)
    ok, tat3 = admission.gcra(tat2, later, 0.5)
    assert ok and tat3 == later + timedelta(seconds=0.5)
    assert not admission.gcra(tat3, later + timedelta(seconds=0.01), 0.5)[0]


@pytest.mark.parametrize(
    "text, expected",
    [("3/s", (3, 1.0)), ("100/m", (100, 60.0)), ("5/10s", (5, 10.0)), ("off", (None, 1.0))],
)
def test_parse_rate__forms(text, expected):
    assert flow.parse_rate(text) == expected


@pytest.mark.parametrize("text", ["3", "0", "0/s", "x/s", "3/d", "-1/s", "5/0s", "5/86401s"])
def test_parse_rate__refuses_what_it_cannot_read(text):
    with pytest.raises(flow.FlowError):
        flow.parse_rate(text)


@pytest.mark.parametrize(
    "scope, ok",
    [
        ("provider:webhook", True),
        ("tenant:acme", True),
        ("kind:permits.report", True),
        ("provider:webhook/tenant:acme", True),
        ("tenant:", False),
        ("webhook", False),
        ("kind:a b", False),
        ("tenant:acme/provider:webhook", False),
        ("queue:reports", True),
        ("queue:-reports", False),
        ("kind:permits.report\n", False),  # Python's $ matches before a trailing newline
        (" kind:permits.report", False),
        ("kind:permits.report ", False),
        ("kind:permits\treport", False),
        ("job:permits.report", False),
    ],
)
def test_check_scope__the_five_forms_whole(scope, ok):
    if ok:
        assert flow.check_scope(scope) == scope
    else:
        with pytest.raises(flow.FlowError):
            flow.check_scope(scope)


# --- the rate on the row ----------------------------------------------------------------


def test_take__at_most_one_start_per_interval_by_the_servers_clock():
    flow.set_rule("provider:webhook", actor="test", rate=5, period_seconds=1.0)
    assert admission.take("provider:webhook").ok
    miss = admission.take("provider:webhook")
    assert not miss.ok and miss.reason == "rate" and 0.0 < miss.delay <= 0.2
    time.sleep(miss.delay + 0.01)
    assert admission.take("provider:webhook").ok


def test_take__no_row_or_no_rate_allows__paused_refuses():
    assert admission.take("provider:nothing").ok
    flow.set_rule("kind:k", actor="test", concurrency=2)
    assert admission.take("kind:k").ok and admission.take("kind:k").ok
    flow.pause("kind:k", actor="test")
    held = admission.take("kind:k")
    assert not held.ok and held.reason == "paused"


def _slow_first_take(monkeypatch, pause: float) -> list[bool]:
    """``admission.take`` that pauses after its first statement ran (the answer comes late)."""
    real, results = admission.take, []

    def take(scope):
        taken = real(scope)
        results.append(taken.ok)
        if len(results) == 1:
            time.sleep(pause)
        return taken

    monkeypatch.setattr(flow, "take", take)
    return results


def test_take_within__a_start_that_came_back_late_is_left_unused(monkeypatch):
    """A sender paused between the take and the call would crowd the next start at the
    provider: the late start is spent unused and the call waits for a fresh one."""
    rule = flow.set_rule("provider:webhook", actor="test", rate=5, period_seconds=1.0)
    monkeypatch.setattr(flow, "_took", deque([0.002], maxlen=32))  # takes usually quick
    results = _slow_first_take(monkeypatch, pause=0.12)  # > 2 ms + 200 ms / 4
    began = time.monotonic()
    gate = flow.Gate("webhook", [], [rule])
    assert flow.take_within(gate, deadline=time.monotonic() + 2.0) == (None, "")
    assert results.count(True) == 2, results  # the late one, then a fresh one
    assert time.monotonic() - began >= 0.2 - 0.01, "the fresh start is an interval later"


def test_take_within__a_far_database_is_not_late(monkeypatch):
    """Every take slow alike (a database far away): the start is used, none wasted."""
    rule = flow.set_rule("provider:webhook", actor="test", rate=5, period_seconds=1.0)
    monkeypatch.setattr(flow, "_took", deque([0.12], maxlen=32))
    results = _slow_first_take(monkeypatch, pause=0.12)
    gate = flow.Gate("webhook", [], [rule])
    assert flow.take_within(gate, deadline=time.monotonic() + 2.0) == (None, "")
    assert results == [True]


@pytest.mark.postgres  # threads on SQLite's in-memory test database meet table locks
def test_take__threads_racing__starts_stay_an_interval_apart():
    """Four threads take as fast as they can for 1.2 s at 10/s: starts ≥ 100 ms apart."""
    flow.set_rule("provider:race", actor="test", rate=10, period_seconds=1.0)
    starts: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = time.monotonic() + 1.2

    def taker():
        try:
            while time.monotonic() < stop:
                if admission.take("provider:race").ok:
                    with lock:
                        starts.append(time.monotonic())
                else:
                    time.sleep(0.005)
        except BaseException as exc:  # a thread that dies must fail the test, not thin it
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=taker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    starts.sort()
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert 10 <= len(starts) <= 14, starts
    # The server's clock spaces them; the client's monotonic clock saw them return
    # with some scheduling noise on a loaded machine.
    assert min(gaps) > 0.05, gaps


# --- rules at the claim -----------------------------------------------------------------


def test_flow_ruled__sql_and_orm_renderings_agree(make_user):
    user = make_user()
    plain = new_job(user, kind="test.steps", tenant="acme", subject="1")
    other = new_job(user, kind="test.short", tenant="beta", subject="2")
    flow.set_rule("kind:test.short", actor="test", rate=None)  # a row that is not active
    flow.set_rule("tenant:acme", actor="test", concurrency=3)
    queued = jobs.request("test.short", ("auth.user", 3), tenant="beta", queue="slow").job
    flow.set_rule("queue:slow", actor="test", concurrency=1)
    orm = dict(Job.objects.annotate(r=rules.flow_ruled_q()).values_list("pk", "r"))
    assert orm == {plain.pk: True, other.pk: False, queued.pk: True}
    if connection.vendor == "postgresql":
        text = rules.flow_ruled_sql("j").text
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT j.id, {text} FROM jobs_job j")
            assert dict(cursor.fetchall()) == orm


def test_claim__paused_kind__deferred_without_an_attempt_then_resumed(make_user):
    user = make_user()
    job = new_job(user, tenant="acme")
    flow.pause("kind:test.steps", actor="test")
    got = runner.claim_for(job.pk, "w1")
    assert got.status == "deferred"
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED and job.attempts == 0 and job.next_attempt_at
    assert got.hold.code == "flow_paused" and job.held_looks == 1
    assert not Attempt.objects.filter(job=job).exists(), "a held look writes no attempt row"
    flow.resume("kind:test.steps", actor="test")
    Job.objects.filter(pk=job.pk).update(next_attempt_at=None)
    assert runner.claim_for(job.pk, "w1").status == "claimed"


@pytest.mark.parametrize("ruled", [True, False])
def test_claim_orm__the_attempt_starts_when_its_lease_did(make_user, monkeypatch, ruled):
    """The record the soak checks the tenant bound with: the lease the attempt implies
    (start + lease) is the lease the row got, not one read a moment later."""
    monkeypatch.setattr(executors, "current", lambda: executors.by_name("orm"))  # the ORM claim
    if ruled:
        flow.set_rule("tenant:acme", actor="test", concurrency=1)
    job = new_job(make_user(), tenant="acme")
    got = runner.claim_for(job.pk, "w1", lease_seconds=2.0)
    assert got.status == "claimed"
    job.refresh_from_db()
    assert got.attempt.started_at == job.lease_expires_at - timedelta(seconds=2.0)
    assert Attempt.objects.get(pk=got.attempt.pk).started_at == got.attempt.started_at


def test_claim__kind_concurrency_from_the_row(make_user):
    user = make_user()
    jobs = [new_job(user, subject=str(n), tenant=f"t{n}") for n in range(3)]
    flow.set_rule("kind:test.steps", actor="test", concurrency=2)
    results = [runner.claim_for(j.pk, f"w{n}").status for n, j in enumerate(jobs)]
    assert results == ["claimed", "claimed", "deferred"]
    assert Job.objects.get(pk=jobs[2].pk).attempts == 0
    flow.set_rule("kind:test.steps", actor="test", concurrency=3)
    Job.objects.filter(pk=jobs[2].pk).update(next_attempt_at=None)
    assert runner.claim_for(jobs[2].pk, "w2").status == "claimed"


def test_claim__tenant_concurrency_row_wins_over_the_setting(make_user, settings):
    settings.JOBS_TENANT_CONCURRENCY = 4
    user = make_user()
    jobs = [new_job(user, subject=str(n), tenant="acme") for n in range(3)]
    flow.set_rule("tenant:acme", actor="test", concurrency=1)
    results = [runner.claim_for(j.pk, f"w{n}").status for n, j in enumerate(jobs)]
    assert results == ["claimed", "deferred", "deferred"]


def test_claim__tenant_rate__deferred_to_the_due_time_plus_one_interval_at_most(make_user):
    user = make_user()
    jobs = [new_job(user, subject=str(n), tenant="acme") for n in range(3)]
    flow.set_rule("tenant:acme", actor="test", rate=1, period_seconds=10.0)
    first = runner.claim_for(jobs[0].pk, "w0")
    second = runner.claim_for(jobs[1].pk, "w1")
    assert (first.status, second.status) == ("claimed", "deferred")
    held = Job.objects.get(pk=jobs[1].pk)
    rule = FlowRule.objects.get(scope="tenant:acme")
    assert held.attempts == 0 and held.state == Job.State.QUEUED
    ahead = (held.next_attempt_at - rule.next_free_at).total_seconds()
    assert -0.5 <= ahead <= 10.5, "due at the next free start, plus jitter within one interval"
    assert second.hold.code == "rate_limited" and held.held_looks == 1
    assert held.deferred_by == "tenant:acme"
    assert not Attempt.objects.filter(job=held).exists()


def test_claim__a_slow_rate__deferred_to_its_next_start_plus_one_interval_at_most(make_user):
    """6 per hour: the held job is due at the rule's next start plus jitter within one
    interval (10 minutes), never spread over the whole hour."""
    user = make_user()
    jobs = [new_job(user, subject=str(n), tenant="acme") for n in range(6)]
    flow.set_rule("tenant:acme", actor="test", rate=6, period_seconds=3600.0)
    assert runner.claim_for(jobs[0].pk, "w0").status == "claimed"
    rule = FlowRule.objects.get(scope="tenant:acme")
    aheads = []
    for job in jobs[1:]:
        assert runner.claim_for(job.pk, "w1").status == "deferred"
        held = Job.objects.get(pk=job.pk)
        aheads.append((held.next_attempt_at - rule.next_free_at).total_seconds())
    assert all(-0.5 <= a <= 600.5 for a in aheads), aheads


def _next(job, worker: str, *, bound: int = 4, lease: float = 30):
    """The next-job claim of ``job``'s queue (where the jobs table is the queue)."""
    return pgclaim.claim_next(job.queue, worker, lease=lease, bound=bound)


def test_claim__no_rule__the_one_statement_claim_still_claims(make_user):
    """A rule on another kind leaves this job to the statement's plain start (PostgreSQL)."""
    user = make_user()
    job = new_job(user, tenant="acme")
    flow.set_rule("kind:test.short", actor="test", concurrency=1)
    if executors.current().name == "postgres":
        got = _next(job, "w1")
        assert got.status == "claimed" and got.job.pk == job.pk
    else:
        assert runner.claim_for(job.pk, "w1").status == "claimed"


@pytest.mark.postgres
def test_next_claim__rules_that_admit__the_statement_claims_the_ruled_job(make_user):
    """An active rule that does not bind is judged in the statement (its verdict: start)."""
    user = make_user()
    a = new_job(user, subject="1", tenant="acme")
    b = new_job(user, subject="2", tenant="beta", kind="test.short")
    flow.set_rule("tenant:acme", actor="test", rate=100)
    flow.set_rule("kind:test.short", actor="test", concurrency=10)
    assert [_next(a, "w1").job.pk, _next(b, "w1").job.pk] == [a.pk, b.pk]
    rule = FlowRule.objects.get(scope="tenant:acme")
    assert rule.next_free_at is not None, "the statement's claim took a start from the rate"


@pytest.mark.postgres
@pytest.mark.parametrize(
    "scope, rule, bound, code, why",
    [
        ("kind:test.steps", {"concurrency": 1}, 4, "flow_concurrency", "the kind's bound"),
        ("tenant:acme", {"concurrency": 1}, 4, "flow_concurrency", "the tenant's row wins"),
        ("tenant:acme", {"rate": 1000}, 1, "flow_concurrency", "the setting's tenant bound"),
        ("queue:default", {"concurrency": 1}, 4, "flow_concurrency", "the queue's bound"),
        ("kind:test.steps", {"rate": 1, "period_seconds": 60.0}, 4, "rate_limited", "kind rate"),
        ("tenant:acme", {"rate": 1, "period_seconds": 60.0}, 4, "rate_limited", "tenant rate"),
        ("queue:default", {"rate": 1, "period_seconds": 60.0}, 4, "rate_limited", "queue rate"),
    ],
)
def test_next_claim__a_rule_that_binds__defers_the_job_by_its_one_verdict(
    make_user, scope, rule, bound, code, why
):
    """The statement's verdict is the decision: the job is deferred as it says (scope,
    reason, delay), no start spent, no attempt counted, and nothing decides again."""
    user = make_user()
    first, second = (new_job(user, subject=str(n), tenant="acme") for n in range(2))
    flow.set_rule(scope, actor="test", **rule)
    assert _next(first, "w1", bound=bound).job.pk == first.pk, why
    before = FlowRule.objects.get(scope=scope).next_free_at
    with CaptureQueriesContext(connection) as queries:
        got = _next(second, "w2", bound=bound)
    assert (got.status, got.job.pk) == ("deferred", second.pk), why
    judged = [q for q in queries if "jobs_flow" in q["sql"]]
    assert len(judged) == 1, "admission ran again after the statement's verdict"
    assert FlowRule.objects.get(scope=scope).next_free_at == before, "no start spent"
    held = Job.objects.get(pk=second.pk)
    assert (held.state, held.attempts) == (Job.State.QUEUED, 0)
    assert held.next_attempt_at is not None, "due again after the verdict's delay"
    assert got.hold.code == code and held.deferred_by == scope, why
    assert held.held_looks == 1 and not Attempt.objects.filter(job=held).exists(), why


@pytest.mark.parametrize(
    "scope", ["kind:test.steps", "tenant:acme", "queue:default"], ids=["kind", "tenant", "queue"]
)
def test_paused_scope__holds_its_waiting_jobs_until_resumed_in_their_old_places(make_user, scope):
    """A pause holds the scope's waiting jobs (``held_by``): no claim reads or defers them.
    A job asked for after the pause is held by the first claim that meets it (its verdict:
    paused; its due time kept). Resuming gives every one back, oldest first."""
    user = make_user()
    before = new_job(user, subject="1", tenant="acme")
    flow.pause(scope, actor="test")
    assert Job.objects.get(pk=before.pk).held_by == scope
    after = new_job(user, subject="2", tenant="acme")
    got = runner.claim_for(after.pk, "w1")
    assert got.status == "deferred" and Job.objects.get(pk=after.pk).held_by == scope
    assert got.hold.code == "flow_paused" and not Attempt.objects.filter(job=after).exists()
    assert runner.claim_for(before.pk, "w1").status != "claimed", "held: nothing to claim"
    assert set(Job.objects.values_list("state", "attempts")) == {(Job.State.QUEUED, 0)}
    flow.resume(scope, actor="test")
    assert not Job.objects.exclude(held_by="").exists()
    first = runner.claim_for(before.pk, "w1")
    assert first.status == "claimed" and first.job.pk == before.pk


@pytest.mark.postgres
def test_next_claim__a_racing_claim_of_a_rated_job__takes_no_start_and_passes(make_user):
    """Another claim is deciding about the same job (it holds the job's claim lock): the
    statement takes no rate start for it, writes nothing, and passes over it."""
    user = make_user()
    job = new_job(user, tenant="acme")
    flow.set_rule("kind:test.steps", actor="test", rate=1, period_seconds=3600)
    with advisory_lock_held(rules.CLAIM_LOCK_CLASS, str(job.pk)):
        assert _next(job, "w1").status == "passed"
    rule = FlowRule.objects.get(scope="kind:test.steps")
    assert rule.next_free_at is None, "no start was taken for the claim that passed"
    assert not Attempt.objects.filter(job=job).exists()
    assert _next(job, "w1").job.pk == job.pk


def _a_lock_waited_for_here() -> bool:
    """Whether a session of this database waits for a lock (other tests run beside)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE NOT l.granted AND a.datname = current_database()"
        )
        return bool(cursor.fetchone()[0])


@pytest.mark.postgres
@pytest.mark.parametrize(
    "lock_class, key, rule",
    [
        (rules.FLOW_LOCK_CLASS, "kind:test.steps", "kind:test.steps"),
        (rules.TENANT_LOCK_CLASS, "acme", None),
        (rules.FLOW_LOCK_CLASS, "queue:default", "queue:default"),
    ],
)
def test_next_claim__a_scope_lock_held__waits_for_it_then_decides(make_user, lock_class, key, rule):
    """Another claim holds a scope's lock (for the length of its statement): the claim
    waits for it, in the one order every claim takes them, and then decides; it never
    gives the job up as busy."""
    user = make_user()
    job = new_job(user, tenant="acme")
    if rule:
        flow.set_rule(rule, actor="test", concurrency=5)
    got = []

    def claim():
        try:
            got.append(_next(job, "w1"))
        finally:
            connections["default"].close()

    with advisory_lock_held(lock_class, key):
        waiting = threading.Thread(target=claim)
        waiting.start()
        # Released as soon as the claim waits for it (the claim waits at most its lock
        # timeout, a second in the suite: a fixed hold raced it on a loaded machine).
        deadline = time.monotonic() + 30
        while not _a_lock_waited_for_here():
            assert time.monotonic() < deadline and not got, "the claim never waited"
            time.sleep(0.01)
        assert waiting.is_alive() and not got, "the claim did not wait for the scope's lock"
    waiting.join(30)
    assert [(g.status, g.job.pk) for g in got] == [("claimed", job.pk)]


@pytest.mark.postgres
@pytest.mark.parametrize(
    "rule, most", [({"concurrency": 2}, 2), ({"rate": 2, "period_seconds": 60.0}, 1)]
)
def test_next_claim__threads_racing__the_kind_rule_holds(make_user, rule, most):
    """Eight connections keep claiming the queue's next job (eight jobs of one kind) for
    two seconds: exactly the rule's worth starts (concurrency 2: two; 2 per minute: one,
    GCRA keeps no burst), whatever the interleaving; the rest are deferred."""
    user = make_user()
    jobs = [new_job(user, subject=str(n), tenant=f"t{n}") for n in range(8)]
    flow.set_rule("kind:test.steps", actor="test", **rule)
    barrier = threading.Barrier(len(jobs))
    won: list[int] = []

    def claim(n):
        try:
            barrier.wait(10)
            until = time.monotonic() + 2
            while time.monotonic() < until:
                got = _next(jobs[0], f"w{n}", bound=100, lease=60)
                if got is not None and got.won:
                    won.append(got.job.pk)
                    return
                time.sleep(0.01)
        finally:
            connections["default"].close()

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(won) == most == len(set(won)), won
    assert Job.objects.filter(state=Job.State.RUNNING).count() == most


# --- changes are audited ----------------------------------------------------------------


def test_jobs_limits__set_pause_resume_show__each_change_audited(capsys):
    call_command("jobs_limits", "set", "provider:webhook", "--rate", "3/s", "--actor", "alice")
    call_command("jobs_limits", "set", "provider:webhook", "--concurrency", "2")
    call_command("jobs_limits", "pause", "provider:webhook", "--actor", "bob")
    call_command("jobs_limits", "resume", "provider:webhook", "--actor", "bob")
    rule = FlowRule.objects.get(scope="provider:webhook")
    assert (rule.rate, rule.period_seconds, rule.concurrency, rule.paused) == (3, 1.0, 2, False)
    changes = list(FlowRuleChange.objects.order_by("id").values_list("action", "actor"))
    assert changes[0] == ("set", "alice") and changes[2:] == [("pause", "bob"), ("resume", "bob")]
    assert changes[1][1].startswith("cli:")
    call_command("jobs_limits", "show")
    out = capsys.readouterr().out
    assert "provider:webhook" in out and "3/1s" in out


def test_cached_rules__a_change_is_seen_within_the_cache_time(settings):
    settings.JOBS_FLOW_CACHE_SECONDS = 0.3
    assert "kind:x" not in flow.cached_rules()
    FlowRule.objects.create(scope="kind:x", paused=True)  # another process's change
    assert "kind:x" not in flow.cached_rules(), "still this process's copy"
    time.sleep(0.35)
    assert flow.cached_rules()["kind:x"].paused


# --- both entry points refuse what the claim could not use (issue 32, item 6) ------------

DAY = "at most 86400 seconds (one day)"
RATE_BOUND = "from 1 to 1,000,000 starts per period"
CONCURRENCY_BOUND = "from 1 to 100,000"
NOT_A_SCOPE = "is not a scope: provider:<name>"
BAD_INPUTS = [
    # (id, scope, --rate, --concurrency, the admin form's rate/period/concurrency, message)
    ("period 1e300 s", "kind:k", "5/1e300s", None, {"rate": 5, "period_seconds": 1e300}, DAY),
    ("period 0", "kind:k", "5/0s", None, {"rate": 5, "period_seconds": 0}, DAY),
    ("period negative", "kind:k", None, None, {"rate": 5, "period_seconds": -1}, DAY),
    ("rate 0", "kind:k", "0/s", None, {"rate": 0}, RATE_BOUND),
    ("rate negative", "kind:k", "-1/s", None, {"rate": -1}, "1 to 1,000,000"),
    ("rate 2^40", "kind:k", f"{2**40}/s", None, {"rate": 2**40}, RATE_BOUND),
    ("concurrency 0", "kind:k", None, "0", {"concurrency": 0}, CONCURRENCY_BOUND),
    ("concurrency negative", "kind:k", None, "-3", {"concurrency": -3}, CONCURRENCY_BOUND),
    ("concurrency 2^40", "kind:k", None, str(2**40), {"concurrency": 2**40}, CONCURRENCY_BOUND),
    ("concurrency 99999999999", "kind:k", None, "99999999999", {}, CONCURRENCY_BOUND),
    ("a newline", "kind:permits.report\n", None, "2", {"concurrency": 2}, NOT_A_SCOPE),
    ("spaces", "kind:permits report", None, "2", {"concurrency": 2}, NOT_A_SCOPE),
    ("unknown prefix", "job:permits.report", None, "2", {"concurrency": 2}, NOT_A_SCOPE),
]


@pytest.mark.parametrize(
    "scope, rate, concurrency, form, message",
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_flow_rule_inputs__refused_with_the_bound_at_both_entry_points(
    scope, rate, concurrency, form, message, admin_client
):
    from django.core.management.base import CommandError

    if rate is not None or concurrency is not None:
        args = ["jobs_limits", "set", scope]
        args += [f"--rate={rate}"] if rate is not None else []  # "-1/s" is no option
        args += [f"--concurrency={concurrency}"] if concurrency is not None else []
        with pytest.raises(CommandError) as refused:
            call_command(*args)
        assert message in str(refused.value), str(refused.value)
    if form:
        data = {"scope": scope, "concurrency": "", "rate": "", "period_seconds": "1"}
        data.update({k: str(v) for k, v in form.items()})
        page = admin_client.post("/admin/jobs/flowrule/add/", data)
        assert page.status_code == 200, "the form comes back with the refusal, no traceback"
        text = html.unescape(page.content.decode())
        assert 'class="errorlist' in text and message in text, text[-3000:]
    assert not FlowRule.objects.exists(), "nothing was stored"
    assert not FlowRuleChange.objects.exists()


def test_set_rule__refuses_out_of_bound_values_for_every_caller():
    for changes in (
        {"period_seconds": 1e300},
        {"period_seconds": float("nan")},
        {"rate": 2**40},
        {"concurrency": True},
        {"concurrency": 2**40},
    ):
        with pytest.raises(flow.FlowError):
            flow.set_rule("kind:k", actor="test", **changes)
    rule = flow.set_rule("queue:reports", actor="test", rate=3, period_seconds=86400.0)
    assert (rule.rate, rule.period_seconds) == (3, 86400.0), "the bound itself is allowed"
    assert not FlowRule.objects.filter(scope="kind:k").exists()


def test_verdict__a_deferral_never_lands_on_a_job_another_claim_started(make_user):
    """The next-job claim's statement commits its verdict (held back) and then records the
    deferral; another claim may start the job in between. CI caught it: the deferral
    moved the running job's version and its worker lost its lease. Now the running job
    is left alone, nothing recorded, and the arrow itself defers only a waiting job."""
    from jobs.engine import job_machine, verdict
    from jobs.engine.plan import Hold

    user = make_user()
    job = new_job(user, tenant="acme")
    started = runner.claim_for(job.pk, "w1")
    assert started.status == "claimed"
    before = Job.objects.get(pk=job.pk)
    hold = Hold("kind:test.steps", "concurrency", 0.5)
    assert verdict.defer(job.pk, "w2", hold).status == "passed"
    assert not job_machine.defer(before, "w2", now=timezone.now(), hold=hold, reclaiming=False)
    after = Job.objects.get(pk=job.pk)
    assert (after.state, after.version, after.lease_owner) == (
        Job.State.RUNNING,
        before.version,
        before.lease_owner,
    )
    assert after.next_attempt_at is None
    assert not Attempt.objects.filter(job=job, outcome=Attempt.Outcome.DEFERRED).exists()


def _in_thread(got: dict, name: str, call) -> threading.Thread:
    """``call`` started on a thread with its own connection; its result, or the error it
    raised (the test's assertion shows it), lands in ``got[name]``."""

    def run():
        try:
            got[name] = call()
        except Exception as exc:
            got[name] = exc
        finally:
            connections["default"].close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _claim_next_waiting(queue: str, worker: str):
    """The next-job claim inside a transaction of the caller's: it waits for locks as long
    as the server lets it (no 2 s cap), so a circle would show as a deadlock."""
    with transaction.atomic():
        return pgclaim.claim_next(queue, worker, lease=60, bound=5)


@pytest.mark.postgres
def test_claims__rows_before_scopes__a_named_claim_and_a_next_claim_never_deadlock(make_user):
    """The engine's claim of a named job (``run_delivery``: django-q2's ``sync``, the
    drill, ``jobs.testing``, a message an older version left) and the next-job claim
    statement meet on one tenant's lock. The statement holds its candidate rows (the
    named job among them, not the one it picked) while it waits for the tenant's lock;
    the named claim, queued first for that lock, gets it. Were it then to wait for its
    job's row, each would wait for the other and the server would end one as a
    deadlock (seen in ``make bench`` when named claims ran on every delivery): it takes
    the row first, tried, so the statement passes over it. Both claims succeed, each
    of its own job (the named claim never swaps)."""
    from jobs.engine import named_claim

    user = make_user()
    named = new_job(user, subject="old", tenant="acme")  # the statement's longest waiting
    got: dict[str, object] = {}

    def waiting_for_tenant_lock() -> int:
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND classid = %s AND database = (SELECT oid FROM pg_database"
                " WHERE datname = current_database())",
                [rules.TENANT_LOCK_CLASS],
            )
            return cursor.fetchone()[0]

    def until(count: int) -> None:
        deadline = time.monotonic() + 30
        while waiting_for_tenant_lock() < count:
            assert time.monotonic() < deadline, f"{count} claims never waited for the lock"
            time.sleep(0.02)

    threads = []
    with advisory_lock_held(rules.TENANT_LOCK_CLASS, "acme"):
        threads.append(
            _in_thread(
                got, "named", lambda: named_claim.claim(named.pk, "w-named", lease=60, bound=5)
            )
        )
        until(1)
        # Asked for now, more urgent: the statement's pick; the named job is its other
        # candidate (longest waiting), locked by it too.
        urgent = new_job(user, subject="urgent", tenant="acme", kind="test.short")
        Job.objects.filter(pk=urgent.pk).update(priority=5)

        threads.append(_in_thread(got, "next", lambda: _claim_next_waiting(named.queue, "w-next")))
        until(2)
    for t in threads:
        t.join(60)
    outcomes = {
        name: (c.status, c.job.pk) if hasattr(c, "status") else repr(c) for name, c in got.items()
    }
    assert outcomes == {
        "named": ("claimed", named.pk),
        "next": ("claimed", urgent.pk),
    }, outcomes


@pytest.mark.postgres
def test_pause__a_claim_waiting_for_the_rules_row__is_passed_over_then_holds_its_job(
    make_user, monkeypatch
):
    """An operator pauses a rated kind while a claim statement holds one of its jobs'
    rows and waits for the rule's row (locked by the pause). The pause's hold passes
    over the row the claim holds (waiting for it would close a circle: a deadlock);
    once the pause commits, the claim's verdict reads the rule again: paused, and the
    claim holds the job itself. Nothing runs, both finish, the job is held."""
    from jobs.engine import held

    user = make_user()
    job = new_job(user, tenant="acme")
    flow.set_rule("kind:test.steps", actor="test", rate=100, period_seconds=60.0)
    rule_locked, go = threading.Event(), threading.Event()
    hold = held.hold

    def paused_hold(scope):
        rule_locked.set()
        assert go.wait(30)
        return hold(scope)

    monkeypatch.setattr(held, "hold", paused_hold)
    got: dict[str, object] = {}

    pause = _in_thread(got, "pause", lambda: flow.pause("kind:test.steps", actor="op"))
    assert rule_locked.wait(30)
    claim = _in_thread(got, "claim", lambda: _claim_next_waiting(job.queue, "w1"))
    deadline = time.monotonic() + 30
    while True:
        with connection.cursor() as cursor:
            # This database's sessions only (other tests run beside this one in CI).
            cursor.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE NOT l.granted AND a.datname = current_database()"
            )
            if cursor.fetchone()[0]:
                break
        assert time.monotonic() < deadline, "the claim never waited for the rule's row"
        time.sleep(0.02)
    go.set()
    for t in (pause, claim):
        t.join(60)
    claimed = got.get("claim")
    outcome = claimed.status if hasattr(claimed, "status") else repr(claimed)
    assert hasattr(got.get("pause"), "paused"), got
    assert outcome == "deferred", got
    job.refresh_from_db()
    assert (job.state, job.held_by) == (Job.State.QUEUED, "kind:test.steps")
