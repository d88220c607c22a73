"""The soak checker's tick promise can fail: made-up histories (no database, no processes)
held against ``checker.ticks_follow_their_schedule``.

A good history holds. Each break fails it: a tick with no job, a job made before its
tick, a job left running, two jobs for the ticks of a ``latest`` outage, a ``latest`` tick
with no job although a dispatcher round ran while it was the newest. (A ``latest`` tick
whose successor was made only after it had come due is a legitimate skip.) An outage
shorter than the interval, with no tick in it, holds too.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from types import SimpleNamespace as NS

import pytest

from tests.chaos import checker

T0 = 1_800_000_000  # a multiple of both intervals (5 s and 3 s)


def ts(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def tick_id(seconds: float) -> str:
    return ts(seconds).strftime("%Y-%m-%dT%H:%M:%SZ")


class Jobs:
    def __init__(self):
        self.pk = 0

    def job(self, kind: str, tick: float, created: float) -> NS:
        self.pk += 1
        return NS(
            pk=self.pk,
            kind=kind,
            subject_type="jobs.tick",
            subject_id=tick_id(tick),
            output_revision=1,
            created_at=ts(created),
            state="succeeded",
            is_terminal=True,
            attempts=1,
            max_attempts=5,
            result={"tick": tick_id(tick)},
            last_error_class="",
            last_error_code="",
            tenant_key="",
        )


def held(jobs: list, *, began: float = T0 + 31, ended: float = T0 + 38) -> dict[str, bool]:
    """Each check's verdict for this history: the database away from ``began`` to ``ended``."""
    window = (ts(T0), ts(T0 + 60))
    history = NS(
        jobs={j.pk: j for j in jobs},
        claimed=defaultdict(list, {j.pk: [NS(outcome="succeeded", number=1)] for j in jobs}),
        inp=NS(
            tick_window={"soak.tick": window, "soak.digest": window},
            outages=[NS(what="database", began=began, ended=ended)],
        ),
        late_ticks=[],
        found={},
    )
    report = checker.Report()
    checker.ticks_follow_their_schedule(history, report)
    assert report.checks, "the promise checked nothing"
    return {what: ok for _, what, ok, _ in report.checks}


def good(made: Jobs) -> list:
    """``all`` every 5 s: the tick at +35, due while the database was away (31-38 s), is made
    at +40; ``latest`` every 3 s: of +33, +36 and +39 (due before the dispatcher was back)
    only +39 gets a job, at +40."""
    jobs = []
    for t in range(T0 + 5, T0 + 61, 5):
        jobs.append(made.job("soak.tick", t, T0 + 40.0 if 31 < t - T0 <= 40 else t + 0.3))
    for t in range(T0 + 3, T0 + 61, 3):
        if t - T0 in (33, 36):
            continue
        jobs.append(made.job("soak.digest", t, T0 + 40.0 if t - T0 == 39 else t + 0.3))
    return jobs


def test_a_good_history_holds():
    verdicts = held(good(Jobs()))
    assert all(verdicts.values()), verdicts


def _without(jobs: list, kind: str, tick: float) -> list:
    return [j for j in jobs if not (j.kind == kind and j.subject_id == tick_id(tick))]


def _early(jobs: list) -> list:
    jobs[2].created_at = ts(T0 + 14.5)  # the +15 tick's job, made before its tick
    return jobs


def _running(jobs: list) -> list:
    jobs[0].state, jobs[0].is_terminal = "running", False
    return jobs


def _two_for_the_outage(jobs: list) -> list:
    return [*jobs, Jobs().job("soak.digest", T0 + 36, T0 + 40)]


@pytest.mark.parametrize(
    "breaks",
    [
        lambda jobs: _without(jobs, "soak.tick", T0 + 20),  # an `all` tick lost
        _early,
        _running,
        _two_for_the_outage,  # `latest` made an older missed tick too
        # A `latest` tick without a job although a dispatcher round ran while it was the
        # newest (that round made the `all` kind's +45 tick at +45.3).
        lambda jobs: _without(jobs, "soak.digest", T0 + 45),
    ],
    ids=["tick missing", "made early", "left running", "latest: two", "latest: skipped"],
)
def test_each_break_fails_the_promise(breaks):
    jobs = breaks(good(Jobs()))
    for n, job in enumerate(jobs, start=1):  # unique ids after a job was added
        job.pk = n
    verdicts = held(jobs)
    assert not all(verdicts.values()), verdicts


def test_an_outage_shorter_than_the_interval_with_no_tick_in_it_holds():
    made = Jobs()
    jobs = [made.job("soak.tick", t, t + 0.3) for t in range(T0 + 5, T0 + 61, 5)]
    jobs += [made.job("soak.digest", t, t + 0.3) for t in range(T0 + 3, T0 + 61, 3)]
    verdicts = held(jobs, began=T0 + 31.5, ended=T0 + 32.5)
    assert all(verdicts.values()), verdicts
