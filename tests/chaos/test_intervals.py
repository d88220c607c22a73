"""The checker's interval arithmetic for the per-tenant bound (pure: no database)."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

from tests.chaos.checker import attempt_slots
from tests.chaos.intervals import Slot, merge, tenant_peaks


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(1_000_000 + seconds, tz=UTC)


def _attempt(job, worker, start, end, outcome, number=1):
    return SimpleNamespace(
        job_id=job,
        worker=worker,
        number=number,
        outcome=outcome,
        started_at=_at(start),
        finished_at=_at(end) if end is not None else None,
    )


def test_merge__joins_overlapping_and_drops_empty():
    assert merge([(3, 4), (0, 2), (1, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]


def test_tenant_peaks__a_reclaimed_job_counts_once():
    # The zombie's attempt and the reclaiming one overlap: still one job.
    slots = [Slot("t", 1, 0, 5), Slot("t", 1, 3, 8), Slot("t", 2, 1, 2)]
    peaks = tenant_peaks(slots)
    assert peaks["t"].count == 2 and peaks["t"].jobs == [1, 2]


def test_tenant_peaks__an_end_makes_room_for_a_start_at_the_same_instant():
    slots = [Slot("t", 1, 0, 2), Slot("t", 2, 0, 2), Slot("t", 3, 2, 4)]
    assert tenant_peaks(slots, bound=2)["t"].count == 2


def test_tenant_peaks__tenants_apart_and_untenanted_jobs_ignored():
    slots = [Slot("a", 1, 0, 2), Slot("b", 2, 0, 2), Slot("", 3, 0, 2), Slot("a", 4, 1, 3)]
    peaks = tenant_peaks(slots)
    assert {t: p.count for t, p in peaks.items()} == {"a": 2, "b": 1}


def test_tenant_peaks__skew_forgives_a_short_overlap_not_a_long_one():
    short = [Slot("t", 1, 0, 1.03), Slot("t", 2, 1.0, 2), Slot("t", 3, 0, 2)]
    assert tenant_peaks(short, bound=2)["t"].count == 3
    assert round(tenant_peaks(short, bound=2)["t"].over, 3) == 0.03
    assert tenant_peaks(short, skew=0.05, bound=2)["t"].count == 2
    long = [Slot("t", 1, 0, 1.5), Slot("t", 2, 1.0, 2), Slot("t", 3, 0, 2)]
    peak = tenant_peaks(long, skew=0.05, bound=2)["t"]
    assert peak.count == 3 and round(peak.over, 2) == 0.4


def _seen(*pairs):
    """Watcher observations: (seen at, lease expires at) in seconds."""
    return [(_at(seen).timestamp(), _at(expires).timestamp()) for seen, expires in pairs]


def _spans(slots):
    return [(s.job, round(s.start - 1_000_000, 2), round(s.end - 1_000_000, 2)) for s in slots]


def test_attempt_slots__a_crashed_claim_ends_at_its_last_lease_not_at_the_reclaim():
    # Claimed at 0 (lease to 2), heartbeat seen at 1.6 (lease to 3.5), killed; reclaimed at 9.
    watcher = SimpleNamespace(leases={(1, "w1"): _seen((0.1, 2), (1.6, 3.5))})
    attempts = [
        _attempt(1, "w1", 0, 9, "crashed"),
        _attempt(1, "w2", 9, 9.4, "succeeded", number=2),
        _attempt(1, "w3", 9.5, 9.5, "duplicate_delivery", number=0),
        _attempt(2, "w4", 4, 9, "lease_lost"),  # no heartbeat seen: the claim's own lease
    ]
    slots, unlogged, gaps = attempt_slots(attempts, {1: "t", 2: "t"}, watcher, now=0, lease=2.0)
    assert _spans(slots) == [(1, 0.0, 3.5), (1, 9.0, 9.4), (2, 4.0, 6.0)]
    assert unlogged == 3 and gaps == 0


def test_attempt_slots__a_lapsed_and_renewed_lease_leaves_a_gap():
    # Paused: the lease ran out at 2; the worker woke at 3.5, heartbeat (lease to 5.5),
    # and published at 4 before anyone reclaimed the job.
    watcher = SimpleNamespace(leases={(1, "w1"): _seen((0.1, 2), (3.6, 5.5))})
    slots, _, gaps = attempt_slots(
        [_attempt(1, "w1", 0, 4, "succeeded")], {1: "t"}, watcher, now=0, lease=2.0
    )
    assert _spans(slots) == [(1, 0.0, 2.0), (1, 3.5, 4.0)]
    assert gaps == 1


def test_attempt_slots__leases_seen_outside_the_attempt_are_not_its_own():
    # The same worker claimed job 1 again later: that lease belongs to the later claim.
    watcher = SimpleNamespace(leases={(1, "w1"): _seen((0.1, 2), (20.1, 23))})
    attempts = [_attempt(1, "w1", 0, 10, "crashed"), _attempt(1, "w1", 20, 21, "succeeded", 2)]
    slots, _, _ = attempt_slots(attempts, {1: "t"}, watcher, now=0, lease=2.0)
    assert _spans(slots) == [(1, 0.0, 2.0), (1, 20.0, 21.0)]


def test_attempt_slots__claims_start_at_their_log_line_and_retries_end_at_theirs():
    # The claim read the clock at 0 but waited for the tenant lock until 0.3; its retry
    # CAS was logged at 1.0 and the outcome recorded at 1.2.
    logged = {
        (1, "w1", 1, "claim"): _at(0.3).timestamp(),
        (1, "w1", 1, "retry"): _at(1.0).timestamp(),
    }
    attempts = [_attempt(1, "w1", 0, 1.2, "retry"), _attempt(2, "w2", 0, 0.8, "succeeded")]
    watcher = SimpleNamespace(leases={})
    slots, unlogged, _ = attempt_slots(attempts, {1: "t", 2: "t"}, watcher, 0, logged, lease=2.0)
    assert _spans(slots) == [(1, 0.3, 1.0), (2, 0.0, 0.8)]
    assert unlogged == 1
