"""Flow rules and the circuit breaker with real qclusters, the dispatcher and the stand-in.

What the provider saw is read from its own record (received times by its clock);
what the engine did from the ledger. Rules are changed from this process while the
workers run: they pick the change up from the rows, without a restart.

``FLOW_OUTAGE_SECONDS`` sets the 503 outage of the circuit test (default 20 s for
``make test``; the issue's 5-minute run: ``FLOW_OUTAGE_SECONDS=300``).
"""

from __future__ import annotations

import os
import time

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from jobs import flow
from jobs.contrib.drills.burst import max_in_window
from jobs.delivery import publish
from jobs.models import Attempt, Effect, EffectEvent, FlowRule, FlowRuleChange, Job
from jobs.registry import EffectSpec
from tests.e2e.processes import PROVIDER_TOKEN, wait_until
from tests.jobs.helpers import request_job

State = Effect.State


def _with_provider(procs, provider, **extra: str) -> None:
    procs.env.update(
        NOTICE_PROVIDER_URL=provider.url,
        NOTICE_PROVIDER_TOKEN=PROVIDER_TOKEN,
        NOTICE_PROVIDER_CONNECT_TIMEOUT="0.5",
        NOTICE_PROVIDER_READ_TIMEOUT="0.5",
        JOBS_EFFECT_LEASE_SECONDS="4",
        JOBS_PROVIDER_SLOT_WAIT_SECONDS="2",
        JOBS_FLOW_CACHE_SECONDS="1",
        **extra,
    )


def pending_webhook_effects(n: int, *, subject: str = "flow") -> list[Effect]:
    """``n`` webhook notices of one finished job, due now on the ledger: the qclusters
    claim and send them (the ledger is their queue)."""
    user = User.objects.create_user(username=f"e2e-{subject}")
    job, _ = request_job(
        "test.notify_only",
        subject_type="auth.user",
        subject_id=subject,
        params={"recipient": user.pk, "providers": ["webhook"]},
    )
    Job.objects.filter(pk=job.pk).update(state=Job.State.SUCCEEDED)
    specs = [
        EffectSpec(f"notice-{i}", "webhook", str(user.pk), {"report_key": f"r-{i}"})
        for i in range(n)
    ]
    rows = publish.prepare(job, specs, refused={})
    now = timezone.now()
    for e in rows:
        e.next_attempt_at = now
    return Effect.objects.bulk_create(rows)


def rate_between(times: list[float], start: float, end: float) -> float:
    return sum(1 for t in times if start <= t < end) / (end - start)


def received(provider) -> list[float]:
    return sorted(r["received_at"] for r in provider.record.requests())


@pytest.mark.drill
def test_webhook_rate__3_per_s_then_20__pause__resume__no_restart(procs, provider):
    _with_provider(procs, provider)
    flow.set_rule("provider:webhook", actor="e2e", rate=3, period_seconds=1.0)
    effects = pending_webhook_effects(400)
    procs.start("qcluster-1", "qcluster")
    procs.start("qcluster-2", "qcluster")
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.2")
    first = wait_until(procs, "the first send", lambda: received(provider), timeout=60)[0]

    # 3/s for 30 s (after a second of warm-up).
    time.sleep(max(0.0, first + 31.5 - time.time()))
    steady = [t for t in received(provider) if first + 1 <= t < first + 31]
    mean = len(steady) / 30
    window = max_in_window(steady, 1.0)
    load = os.getloadavg()[0]
    print(f"3/s rule: mean {mean:.2f}/s over 30 s, most in a 1 s window {window} (load {load:.1f})")

    # Raised to 20/s: the rate rises within 2 s.
    raised_at = time.time()
    flow.set_rule("provider:webhook", actor="e2e", rate=20, period_seconds=1.0)
    time.sleep(6.5)
    times = received(provider)
    before = rate_between(times, raised_at - 3, raised_at)
    after = rate_between(times, raised_at + 2, raised_at + 6)
    # The promise is that the new rule binds without a restart: from 2 s after the change
    # some 1 s window holds more sends than the old rule ever let through (3 + 1 for its
    # edges). How near 20/s it gets is the machine's (4.5/s on a loaded CI run).
    raised_window = max_in_window([t for t in times if t >= raised_at + 2], 1.0)
    print(
        f"raised to 20/s: {before:.1f}/s before, {after:.1f}/s from 2 s after the change, "
        f"most in a 1 s window {raised_window}"
    )

    # Paused: no new send starts 2 s after; resumed: sends continue.
    paused_at = time.time()
    flow.pause("provider:webhook", actor="e2e")
    time.sleep(5)
    late = [t for t in received(provider) if t > paused_at + 2]
    resumed_at = time.time()
    flow.resume("provider:webhook", actor="e2e")
    wait_until(
        procs,
        "sends after the resume",
        lambda: [t for t in received(provider) if t > resumed_at],
        timeout=10,
    )
    resumed_after = min(t for t in received(provider) if t > resumed_at) - resumed_at
    print(
        f"paused: {len(late)} sends started > 2 s after; "
        f"first send {resumed_after:.2f} s after resume"
    )
    for proc in procs.procs:
        procs.terminate(proc)

    assert 2.7 <= mean <= 3.3, f"mean {mean:.2f}/s"
    assert window <= 4, f"{window} sends in one 1 s window (3 + 1 for its edges)"
    assert raised_window > 4, f"the rate did not rise within 2 s: {after:.1f}/s"
    assert late == [], f"{len(late)} sends started more than 2 s after the pause"
    assert resumed_after < 3
    # Nothing sent twice; nothing spent an attempt while held back.
    record = provider.record
    assert record.duplicate_effects() == {}
    keys = [r["idempotency_key"] for r in record.requests()]
    assert len(keys) == len(set(keys)), "each notice reached the provider once"
    assert {r["status"] for r in record.requests()} == {201}
    ids = [e.pk for e in effects]
    spent = Effect.objects.filter(pk__in=ids, attempts__gt=1).count()
    assert spent == 0
    spent_elsewhere = list(
        Effect.objects.filter(pk__in=ids, attempts=1)
        .exclude(state__in=[State.APPLIED, State.SENDING])
        .values("pk", "state", "version", "last_error_code", "next_attempt_at")
    )
    assert spent_elsewhere == [], (
        "an attempt was spent only by a send",
        spent_elsewhere,
        [
            (e.effect_id, e.action, e.attempt, e.error_code)
            for e in EffectEvent.objects.filter(effect_id__in=[r["pk"] for r in spent_elsewhere])
        ],
    )
    assert Effect.objects.filter(pk__in=ids, state=State.APPLIED).count() == len(keys)
    held = EffectEvent.objects.filter(
        effect_id__in=ids,
        action=EffectEvent.Action.DEFER,
        error_code__in=["rate_limited", "flow_paused"],
    ).count()
    print(f"deferrals by the rule (no attempt spent): {held}")


@pytest.mark.drill
def test_provider_503_outage__circuit_opens_and_closes__only_probes_spend_attempts(procs, provider):
    outage = float(os.environ.get("FLOW_OUTAGE_SECONDS", "20"))
    _with_provider(
        procs,
        provider,
        JOBS_CIRCUIT_FAILURES="5",
        JOBS_CIRCUIT_PROBE_SECONDS="1",
        JOBS_CIRCUIT_PROBE_CAP_SECONDS="30",
    )
    provider.faults.unavailable = 1.0
    provider.faults.retry_after = 0
    effects = pending_webhook_effects(20, subject="outage")
    ids = [e.pk for e in effects]
    started = time.monotonic()
    procs.start("qcluster-1", "qcluster")
    procs.start("qcluster-2", "qcluster")
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.2")
    wait_until(
        procs,
        "the circuit to open",
        lambda: FlowRule.objects.filter(scope="provider:webhook", circuit_state="open").exists(),
        timeout=60,
    )
    time.sleep(max(0.0, outage - (time.monotonic() - started)))
    attempts_at_recovery = sum(Effect.objects.filter(pk__in=ids).values_list("attempts", flat=True))
    failed = [r for r in provider.record.requests() if r["status"] == 503]
    provider.faults.unavailable = 0.0
    recovered = time.monotonic()
    wait_until(
        procs,
        "every notice applied",
        lambda: Effect.objects.filter(pk__in=ids, state=State.APPLIED).count() == len(ids),
        timeout=120,
    )
    drained = time.monotonic() - recovered
    # Every attempt is spent by a call, counted once everything settled: a send spends
    # its attempt when it is claimed, a moment before its call, so a count taken at the
    # switch can hold a probe whose call comes after it (seen twice on a loaded machine,
    # even 1 s later). A call that failed while the circuit was already open gives its
    # attempt back (the calls above the attempts).
    attempts = sum(Effect.objects.filter(pk__in=ids).values_list("attempts", flat=True))
    calls = len(provider.record.requests())
    changes = list(
        FlowRuleChange.objects.filter(scope="provider:webhook", action="circuit")
        .order_by("id")
        .values_list("after", flat=True)
    )
    probes_failed = sum(1 for c in changes if "probe failed" in c)
    print(
        f"503 for {outage:.0f} s: {len(failed)} calls answered 503 "
        f"({probes_failed} failed probes); "
        f"attempts spent by the switch {attempts_at_recovery}; in all {attempts} attempts "
        f"for {calls} calls (given back {calls - attempts}); all {len(ids)} applied "
        f"{drained:.1f} s after recovery; circuit: {changes}"
    )
    assert changes[0].startswith("open") and changes[-1].startswith("closed")
    assert FlowRule.objects.get(scope="provider:webhook").circuit_state == "closed"
    # Attempts: the calls that opened it (the threshold, plus senders already in their
    # call), then only probes. A sender that read the circuit closed a moment before
    # another opened it may still call: that failure is the outage's, its attempt
    # given back (the 503s above the attempts spent). Plus one: a probe claimed just
    # before the switch whose call came after it (it succeeded and closed the circuit).
    bound = 5 + 2 + probes_failed + 1
    assert attempts_at_recovery <= bound, (attempts_at_recovery, probes_failed)
    assert attempts <= calls, f"an attempt was spent without a call: {attempts} for {calls}"
    record = provider.record
    assert record.duplicate_effects() == {} and len(record.sends()) == len(ids)
    assert Effect.objects.filter(pk__in=ids, state=State.NEEDS_REVIEW).count() == 0


def _overlap(intervals: list[tuple]) -> int:
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


def test_kind_concurrency_and_tenant_rate_at_the_claim__two_qclusters(procs, make_user):
    # A lease longer than the work on a machine loaded 10x (CI saw a 4 s lease run out at
    # load 9.9): the kind's bound counts running jobs whose lease is live, so a lease lost
    # under load frees its slot while that worker still runs (DESIGN: a lease limits work
    # only for a while), and the job runs again. Lease < Q timeout < retry, as checked.
    procs.env.update(
        TEST_Q_WORKERS="3",
        JOBS_FLOW_CACHE_SECONDS="1",
        JOBS_LEASE_SECONDS="15",
        TEST_Q_TIMEOUT="20",
        TEST_Q_RETRY="25",
    )
    user = make_user()
    flow.set_rule("kind:test.short", actor="e2e", concurrency=2)
    flow.set_rule("tenant:rated", actor="e2e", rate=2, period_seconds=1.0)
    bounded = [
        request_job(
            "test.short",
            subject_type="auth.user",
            subject_id=f"k{n}",
            tenant_key=f"t{n}",
            params={"recipients": [user.pk], "stages": 2, "stage_sleep": 0.2},
        )[0]
        for n in range(10)
    ]
    rated = [
        request_job(
            "test.steps",
            subject_type="auth.user",
            subject_id=f"r{n}",
            tenant_key="rated",
            params={"recipients": [user.pk]},
        )[0]
        for n in range(12)
    ]
    procs.start("qcluster-1", "qcluster")
    procs.start("qcluster-2", "qcluster")
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.2")
    every = [j.pk for j in bounded + rated]
    wait_until(
        procs,
        "every job to succeed",
        lambda: Job.objects.filter(pk__in=every, state=Job.State.SUCCEEDED).count() == len(every),
        timeout=180,
    )
    claimed = Attempt.objects.filter(number__gt=0).exclude(
        outcome__in=[Attempt.Outcome.DEFERRED, Attempt.Outcome.DUPLICATE_DELIVERY]
    )
    bounded_attempts = claimed.filter(job__in=[j.pk for j in bounded])
    lost_leases = bounded_attempts.filter(outcome=Attempt.Outcome.LEASE_LOST)
    lost = list(lost_leases.values_list("job", "number"))
    runs = list(
        bounded_attempts.exclude(outcome=Attempt.Outcome.LEASE_LOST).values_list(
            "started_at", "finished_at"
        )
    )
    starts = [
        s.timestamp()
        for s in claimed.filter(job__in=[j.pk for j in rated]).values_list("started_at", flat=True)
    ]
    # A deferral writes no attempt row: each held look is counted on its job.
    looks = dict(Job.objects.filter(pk__in=every).values_list("pk", "held_looks"))
    held_bound = sum(looks[j.pk] for j in bounded)
    held_rate = sum(looks[j.pk] for j in rated)
    print(
        f"kind concurrency 2: most running at once {_overlap(runs)}; tenant 2/s: most claims "
        f"in 1 s {max_in_window(starts, 1.0)}; held looks: bound {held_bound}, rate "
        f"{held_rate}; load {os.getloadavg()[0]:.1f}; leases lost (job, attempt) {lost}"
    )
    assert _overlap(runs) <= 2, sorted(
        bounded_attempts.values_list("job", "number", "outcome", "started_at", "finished_at"),
        key=lambda row: row[3],
    )
    assert max_in_window(starts, 1.0) <= 3
    assert held_bound > 0, "the bound was met"
    assert held_rate > 0, "the rate was met"
    assert not Attempt.objects.filter(outcome=Attempt.Outcome.DEFERRED).exists()
    assert set(Job.objects.filter(pk__in=every).values_list("attempts", flat=True)) == {1}
