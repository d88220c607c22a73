"""Deferrals that follow the rules (issue 42, part 4; docs/app/flow.md).

PostgreSQL, the next-job claim (a cluster's dequeue) as workers make it:

- a rate rule deleted or loosened live makes the jobs it deferred due at once (their due
  time is read back by the server's clock; the time until every one started is printed,
  polled up to a generous timeout: this machine is shared);
- with ``--rate 6/h`` a deferred job is due at the rule's next allowed start plus jitter
  within one interval (10 minutes), and a concurrency hold of that rule comes back within
  about a second, never an hour away;
- holding a job back writes no attempt row: 60 simulated seconds of claims over a paused
  scope with 50 held jobs add none; the looks are counted on the jobs.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db.models import F
from django.db.models.functions import Now

from jobs import flow
from jobs.models import Attempt, FlowRule, Job
from tests.jobs.helpers import claim_next, new_job

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

TENANT = "springfield"
SCOPE = f"tenant:{TENANT}"
SLOW = {"rate": 6, "period_seconds": 3600.0}  # 6/h: one start every 10 minutes


def _ask(count: int, tenant: str = TENANT) -> list[Job]:
    return [new_job(subject=f"{tenant}-{n}", tenant=tenant) for n in range(count)]


def _claim_all(limit: int) -> list:
    """Next-job claims of the default queue until none is due (at most ``limit``)."""
    got = []
    for _ in range(limit):
        claim = claim_next("default", "w-defer", bound=100)
        if claim is None:
            break
        got.append(claim)
    return got


def _deferred_by_the_slow_rate(count: int) -> list[Job]:
    """``count`` jobs under 6/h: the first claim starts one, the rest are deferred to the
    rule's next start (no attempt row each: a held look on the job)."""
    jobs = _ask(count)
    flow.set_rule(SCOPE, actor="test", **SLOW)
    claims = _claim_all(count + 2)
    statuses = [c.status for c in claims]
    assert statuses.count("claimed") == 1 and statuses.count("deferred") == count - 1, statuses
    held = Job.objects.filter(pk__in=[j.pk for j in jobs], state=Job.State.QUEUED)
    assert set(held.values_list("deferred_by", flat=True)) == {SCOPE}
    assert not Attempt.objects.filter(outcome=Attempt.Outcome.DEFERRED).exists()
    return list(held)


def _due_after_change(held: list[Job]) -> float:
    """Seconds past the change (server clock) by which every held job is due again."""
    rows = Job.objects.annotate(now=Now()).filter(pk__in=[j.pk for j in held])
    return max((r.next_attempt_at - r.now).total_seconds() for r in rows)


def _started_within(held: list[Job], timeout: float = 60.0) -> float:
    """Seconds until the claims started every held job (polled; printed by the caller)."""
    started = time.monotonic()
    ids = {j.pk for j in held}
    while time.monotonic() - started < timeout:
        _claim_all(len(ids) + 2)
        if not Job.objects.filter(pk__in=ids).exclude(state=Job.State.RUNNING).exists():
            return time.monotonic() - started
        time.sleep(0.05)
    pytest.fail(f"not every held job started within {timeout:.0f} s")


@pytest.mark.parametrize(
    "change",
    ["delete", "rate off", "rate 6/h -> 60/s", "concurrency 1 -> 5"],
)
def test_rule_deleted_or_loosened_live__the_jobs_it_deferred_start_at_once(change):
    if change.startswith("concurrency"):
        running = _ask(1, tenant=TENANT)[0]
        flow.set_rule(SCOPE, actor="test", concurrency=1)
        assert claim_next("default", "w-defer", bound=100).job.pk == running.pk
        held = [new_job(subject=f"{TENANT}-late-{n}", tenant=TENANT) for n in range(3)]
        assert {c.status for c in _claim_all(5)} == {"deferred"}
    else:
        held = _deferred_by_the_slow_rate(5)
        assert _due_after_change(held) > 60, "held back by the rate before the change"
    if change == "delete":
        flow.delete_rule(SCOPE, actor="ops")
    elif change == "rate off":
        flow.set_rule(SCOPE, actor="ops", rate=None)
    elif change.startswith("rate"):
        flow.set_rule(SCOPE, actor="ops", rate=60, period_seconds=1.0)
    else:
        flow.set_rule(SCOPE, actor="ops", concurrency=5)
    due = _due_after_change(held)
    took = _started_within(held)
    print(f"{change}: due {due:+.3f} s after the change, all {len(held)} started in {took:.2f} s")
    assert due <= 0.0, "the change made them due at once, not at the old rule's deadline"
    assert set(
        Job.objects.filter(pk__in=[j.pk for j in held]).values_list("deferred_by", flat=True)
    ) == {""}


def test_rule_tightened__the_jobs_it_deferred_keep_their_due_times():
    held = _deferred_by_the_slow_rate(3)
    before = dict(
        Job.objects.filter(pk__in=[j.pk for j in held]).values_list("pk", "next_attempt_at")
    )
    flow.set_rule(SCOPE, actor="ops", rate=3, period_seconds=3600.0)
    after = dict(
        Job.objects.filter(pk__in=[j.pk for j in held]).values_list("pk", "next_attempt_at")
    )
    assert after == before


def test_rate_6_per_hour__deferred_to_the_next_allowed_start_within_one_interval():
    """The 7 jobs of the issue: each deferral is due at the rule's next allowed start plus
    jitter within one interval (600 s), never pushed over the period (up to 3,600 s)."""
    held = _deferred_by_the_slow_rate(8)
    rule = FlowRule.objects.get(scope=SCOPE)
    aheads = sorted(
        (j.next_attempt_at - rule.next_free_at).total_seconds()
        for j in Job.objects.filter(pk__in=[h.pk for h in held])
    )
    print(f"7 deferred jobs due after the next allowed start by {[round(a) for a in aheads]} s")
    assert all(-0.5 <= a <= rule.interval_seconds + 0.5 for a in aheads), aheads


def test_rate_6_per_hour_with_a_busy_bound__the_concurrency_hold_comes_back_within_seconds():
    """A concurrency hold of a rule that also has a slow rate waits for a slot, which any
    finishing job frees: due within about a second, not spread over the rate's hour."""
    first, second = _ask(2)
    flow.set_rule(SCOPE, actor="test", concurrency=1, **SLOW)
    assert claim_next("default", "w-defer", bound=100).job.pk == first.pk
    held = claim_next("default", "w-defer", bound=100)
    assert (held.status, held.hold.reason) == ("deferred", "concurrency")
    due = _due_after_change([second])
    print(f"concurrency hold under 6/h: due in {due:.2f} s")
    assert due <= 1.5, due


def test_paused_scope__60_seconds_of_claims_over_50_held_jobs_add_no_attempt_row():
    """Half the jobs held by the pause itself, half asked for after it (held by the first
    claim that meets each). Every simulated second the claims look again (the due times
    moved one second back, as if a second passed): no attempt row, the looks counted."""
    before = _ask(25)
    flow.pause(SCOPE, actor="ops")
    after = [new_job(subject=f"{TENANT}-after-{n}", tenant=TENANT) for n in range(25)]
    ids = [j.pk for j in before + after]
    looks = 0
    for _ in range(60):
        Job.objects.filter(pk__in=ids).update(
            next_attempt_at=F("next_attempt_at") - timedelta(seconds=1),
            created_at=F("created_at") - timedelta(seconds=1),
        )
        claims = _claim_all(60)
        assert {c.status for c in claims} <= {"deferred"}, claims
        looks += len(claims)
    assert not Attempt.objects.filter(job_id__in=ids).exists()
    assert Job.objects.filter(pk__in=ids, held_by=SCOPE).count() == 50
    counted = sum(Job.objects.filter(pk__in=ids).values_list("held_looks", flat=True))
    print(f"60 s paused, 50 held: {looks} claims met a held job, {counted} looks counted")
    assert counted == looks == 25, "each job asked for after the pause is held by one look"
    flow.resume(SCOPE, actor="ops")
    assert len([c for c in _claim_all(60) if c.won]) == 50
