"""The soak's flow-rule promises, one small check each (added to the checker's report).

- the provider's rate rule held at the stand-in's own record: no window of one period
  holds more than ``rate`` calls, +1 for the window's edge;
- a tenant's concurrency rule held in the recorded attempt slots (the same slots the
  checker's tenant bound uses: claims to transitions, cut to the leases held);
- work held back by a rule spent no attempt: every flow deferral hands the attempt back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobs.contrib.drills.burst import max_in_window

if TYPE_CHECKING:
    from tests.chaos.checker import Inputs, Report

FLOW_CODES = ("rate_limited", "flow_paused", "flow_concurrency", "flow_busy", "circuit_open")


def provider_rate_held(inp: Inputs) -> tuple[str, bool, str]:
    """No window of the rule's period at the provider above the rate (+1 for its edge)."""
    from jobs import flow
    from jobs.testing.fakeprovider import Record

    rate, period = flow.parse_rate(inp.cfg.provider_rate)
    calls = sorted(Record(inp.record).requests(), key=lambda r: r["received_at"])
    times = [r["received_at"] for r in calls]
    # How late the stand-in's own threads read a call after it arrived (not counted).
    lag = max((r["read_at"] - r["received_at"] for r in calls if r["read_at"]), default=0.0)
    most = max_in_window(times, period)
    first, last = (times[0], times[-1]) if times else (0.0, 0.0)
    mean = len(times) / (last - first) if last > first else 0.0
    # The margin: the shortest span of rate + 2 calls (one too many for a window) must
    # stay at least one period; how far above it shows how close the run came.
    over = rate + 2
    spans = [b - a for a, b in zip(times, times[over - 1 :], strict=False)]
    margin = f"; {over} calls never within {min(spans):.3f} s" if spans else ""
    margin += f"; the stand-in read calls up to {lag * 1000:.0f} ms after they arrived"
    unused = sum(
        path.read_text(errors="replace").count("start left unused")
        for path in inp.logs.glob("*.log")
    )
    margin += f"; {unused} starts that came back late left unused"
    return (
        f"flow: provider rate rule {inp.cfg.provider_rate} held at the provider's record",
        most <= rate + 1,
        f"most calls in one {period:g} s window {most} (rule {rate}, +1 edge); "
        f"{len(times)} calls, {mean:.2f}/s from first to last{margin}",
    )


def tenant_rule_held(inp: Inputs) -> tuple[str, bool, str]:
    """The ruled tenant's running jobs never above its rule, in the recorded slots."""
    from jobs.models import Attempt, Job
    from tests.chaos import checker
    from tests.chaos.intervals import tenant_peaks

    tenant, bound = inp.cfg.ruled_tenant, inp.cfg.ruled_tenant_concurrency
    tenant_of = dict(Job.objects.values_list("pk", "tenant_key"))
    attempts = list(Attempt.objects.order_by("id"))
    slots, _, _ = checker.attempt_slots(
        attempts,
        tenant_of,
        inp.watcher,
        checker._now(),
        checker.transition_times(inp.logs),
        lease=inp.cfg.lease,
    )
    peaks = tenant_peaks(
        [s for s in slots if s.tenant == tenant], skew=checker.CLOCK_SKEW_SECONDS, bound=bound
    )
    peak = peaks.get(tenant)
    count = peak.count if peak is not None else 0
    return (
        f"flow: tenant rule tenant:{tenant} concurrency {bound} held in the attempt slots",
        count <= bound,
        f"peak {count}" + (f" jobs {peak.jobs}" if peak is not None and count > bound else ""),
    )


def held_back_spent_nothing(inp: Inputs) -> tuple[str, bool, str]:
    """Deferrals by a rule write no attempt row and count a held look on the job (jobs),
    and give the send back (effects)."""
    from django.db.models import Sum

    from jobs.models import Attempt, EffectEvent, Job

    spent = Attempt.objects.filter(outcome=Attempt.Outcome.DEFERRED).count()
    looks = Job.objects.aggregate(n=Sum("held_looks"))["n"] or 0
    defers = EffectEvent.objects.filter(action=EffectEvent.Action.DEFER, error_code__in=FLOW_CODES)
    # The claim before a deferral counted one attempt; the deferral's row shows it given back.
    claims = {
        (e, v): a
        for e, v, a in EffectEvent.objects.filter(action=EffectEvent.Action.CLAIM).values_list(
            "effect", "version", "attempt"
        )
    }
    kept = [
        (e, v)
        for e, v, a in defers.values_list("effect", "version", "attempt")
        if (e, v - 1) in claims and a != claims[(e, v - 1)] - 1
    ]
    by_code = {"job held looks": looks}
    by_code |= {code: defers.filter(error_code=code).count() for code in FLOW_CODES}
    return (
        "flow: work held back by a rule spent no attempt (jobs and effects)",
        spent == 0 and not kept,
        f"deferrals {', '.join(f'{k} {v}' for k, v in by_code.items() if v) or 'none'}"
        + (
            f"; {spent} job deferrals with a number, {len(kept)} effect deferrals kept theirs"
            if spent or kept
            else ""
        ),
    )


def check_flow(inp: Inputs, report: Report) -> None:
    """Add the flow rows to the checker's report (the rules the soak set)."""
    if inp.cfg.provider_rate:
        report.check(*provider_rate_held(inp))
    if inp.cfg.ruled_tenant and inp.cfg.ruled_tenant_concurrency:
        report.check(*tenant_rule_held(inp))
    report.check(*held_back_spent_nothing(inp))
