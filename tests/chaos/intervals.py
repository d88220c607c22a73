"""How many jobs of one tenant held a live lease at once, from recorded intervals (pure).

The engine's bound (``JOBS_TENANT_CONCURRENCY``) counts *jobs* in ``running`` whose
lease still holds (``Job.objects.live_running``). A job's time in that state is the
union of its claimed attempts' slots, so a reclaimed job and the zombie it was taken
from are one job, never two. How the checker derives each slot from the history
(and why crashed attempts end at their last lease, not at their ``finished_at``) is
explained in ``tests.chaos.checker.attempt_slots``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Slot:
    """One claimed attempt's stay in ``running`` with a live lease (epoch seconds)."""

    tenant: str
    job: int
    start: float
    end: float


@dataclass
class Peak:
    """The most jobs of one tenant live at one instant, when, and which.

    ``over`` is the longest stretch (seconds) with more than ``bound`` jobs live,
    when a bound was given: how long a breach lasted, or how large the clock skew is.
    """

    count: int = 0
    at: float = 0.0
    jobs: list[int] = field(default_factory=list)
    over: float = 0.0


def merge(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of closed intervals, sorted; empty intervals are dropped."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def tenant_peaks(
    slots: Iterable[Slot], *, skew: float = 0.0, bound: int | None = None
) -> dict[str, Peak]:
    """Per tenant, the largest number of distinct jobs whose slots cover one instant.

    ``skew`` trims that much off both ends of every job's spans before counting,
    so an overlap must last longer than ``2 * skew`` to count: the recorded
    instants are taken a moment before or after the commit that really moved the
    job, at the resolution of a log line.
    """
    spans: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for slot in slots:
        if slot.tenant:
            spans[(slot.tenant, slot.job)].append((slot.start, slot.end))
    events: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
    for (tenant, job), intervals in spans.items():
        for start, end in merge(intervals):
            start, end = start + skew, end - skew
            if end > start:
                events[tenant].append((start, 1, job))
                events[tenant].append((end, -1, job))
    peaks: dict[str, Peak] = {}
    for tenant, edges in events.items():
        # At one instant a job that ends makes room before one that starts.
        edges.sort(key=lambda e: (e[0], e[1]))
        live: set[int] = set()
        peak = Peak()
        over_since = None
        longest = 0.0
        for at, step, job in edges:
            if step > 0:
                live.add(job)
            else:
                live.discard(job)
            if len(live) > peak.count:
                peak = Peak(len(live), at, sorted(live))
            if bound is not None:
                if len(live) > bound and over_since is None:
                    over_since = at
                elif len(live) <= bound and over_since is not None:
                    longest = max(longest, at - over_since)
                    over_since = None
        peak.over = longest
        peaks[tenant] = peak
    return peaks
