"""``ctx.progress``: stored on the job, fenced by owner like a heartbeat, at most one write a
second counted from the claim (the last call of a second is written by the next call
after it, or with the publish), read back by ``handle.progress``; a long or multi-line
note is refused."""

from __future__ import annotations

import pytest

import jobs
from jobs.delivery import runner
from jobs.delivery.runner import run_delivery
from jobs.engine import job_machine
from jobs.exceptions import JobTimeout, LeaseLost
from jobs.models import Attempt, Job
from jobs.registry import kinds, register_kind
from tests.jobs.helpers import expire_lease, request_job

KIND = "test.progress"
TIMED = "test.progress.timed"
CLOCK = {"now": 0.0}
SEEN: dict[str, object] = {}


class FakeTime:
    """The runner's monotonic clock, moved by the handler: the throttle without waiting."""

    @staticmethod
    def monotonic() -> float:
        return CLOCK["now"]


def _handler(ctx):
    script = ctx.params["script"]
    for at, done, note in script:
        CLOCK["now"] = at
        if note == "@reclaim":
            expire_lease(ctx.job)
            assert runner.claim_for(ctx.job.pk, "w-other").won
            continue
        if note == "@cancel":
            jobs.cancel(ctx.job.pk, actor="operator:ana")
            continue
        try:
            ctx.progress(done, ctx.params.get("total"), note)
        except (LeaseLost, JobTimeout) as exc:
            SEEN["raised"] = type(exc).__name__
            raise
    return []


# 4 s: below the suite's Q_CLUSTER timeout (5), or jobs.E007 fails every `check` in this process.
for _name, _timeout in ((KIND, None), (TIMED, 4)):
    if _name not in kinds():
        register_kind(_name, _handler, timeout=_timeout)


@pytest.fixture
def fake_clock(monkeypatch, settings):
    settings.JOBS_LEASE_SECONDS = 60  # the fake clock never makes a heartbeat due
    CLOCK["now"] = 0.0
    SEEN.clear()
    monkeypatch.setattr(runner, "time", FakeTime)
    writes: list[tuple] = []
    real = job_machine.progress

    def spy(job, worker, **values):
        won = real(job, worker, **values)
        writes.append((values["done"], values["note"], won))
        return won

    monkeypatch.setattr(job_machine, "progress", spy)
    return writes


def _job(subject: int, script: list, *, kind: str = KIND, total: int | None = 100) -> Job:
    params = {"script": script, "total": total}
    job, _ = request_job(kind, subject_type="test", subject_id=subject, params=params)
    return job


@pytest.mark.django_db(transaction=True)
def test_progress__at_most_a_write_a_second_the_last_call_written_at_the_end(fake_clock):
    script = [[i / 5, i, f"step {i}"] for i in range(12)]  # 0.0, 0.2, ... 2.2 s
    job = _job(1, script)
    handle = jobs.request(KIND, ("test", 1), params=job.params)
    assert handle.progress is None
    assert run_delivery(job.pk, worker="w1").outcome == Attempt.Outcome.SUCCEEDED
    # The claim at 0 s counts as the first word: writes at 1 s and 2 s; step 11 (2.2 s) was
    # kept and written with the publish (its job update, not a progress write of its own).
    assert [(done, note) for done, note, _ in fake_clock] == [(5, "step 5"), (10, "step 10")]
    progress = handle.progress
    assert (progress.done, progress.total, progress.note) == (11, 100, "step 11")
    assert progress.fraction == pytest.approx(0.11)
    assert progress.at is not None
    assert handle.job.progress_done == 11


@pytest.mark.django_db(transaction=True)
def test_progress__a_stale_workers_progress_is_refused(fake_clock):
    """Another worker reclaimed the job: this one's next write fails its fence."""
    job = _job(2, [[1.0, 1, "one"], [1.5, 0, "@reclaim"], [2.5, 2, "two"]])
    result = run_delivery(job.pk, worker="w1")
    assert result.outcome == Attempt.Outcome.LEASE_LOST
    assert SEEN["raised"] == "LeaseLost"
    assert [(done, won) for done, _, won in fake_clock] == [(1, True), (2, False)]
    job.refresh_from_db()
    assert (job.progress_done, job.progress_note, job.lease_owner) == (1, "one", "w-other")


@pytest.mark.django_db(transaction=True)
def test_progress__after_a_cancel_the_handler_stops(fake_clock):
    job = _job(3, [[1.0, 1, "one"], [1.1, 0, "@cancel"], [2.5, 2, "two"]])
    assert run_delivery(job.pk, worker="w1").outcome == Attempt.Outcome.CANCELLED
    assert SEEN["raised"] == "JobCancelled"
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED and job.progress_done == 1


@pytest.mark.django_db(transaction=True)
def test_progress__past_the_kinds_timeout_raises_the_timeout(fake_clock):
    job = _job(4, [[1.0, 1, "one"], [6, 2, "two"]], kind=TIMED)
    assert run_delivery(job.pk, worker="w1").outcome == Attempt.Outcome.RETRY
    assert SEEN["raised"] == "JobTimeout"
    job.refresh_from_db()
    assert (job.last_error_code, job.progress_done) == ("timeout", 1)


@pytest.mark.parametrize(
    ("done", "total", "note", "says"),
    [
        (1, 10, "x" * 121, "at most 120 characters"),
        (1, 10, "line one\nline two", "one line of printable text"),
        (1, 10, "tab\there", "one line of printable text"),
        (-1, 10, "", "done must be a whole number"),
        (1.5, 10, "", "done must be a whole number"),
        (True, 10, "", "done must be a whole number"),
        (1, -10, "", "total must be a whole number"),
    ],
)
def test_progress__a_note_or_count_out_of_bounds_is_refused(done, total, note, says):
    with pytest.raises(ValueError, match=says) as caught:
        runner._checked_progress(done, total, note)
    assert "line one" not in str(caught.value) and "xxx" not in str(caught.value)


def test_progress__a_note_of_120_characters_and_no_total_is_fine():
    assert runner._checked_progress(3, None, "é" * 120) == (3, None, "é" * 120)


@pytest.mark.django_db(transaction=True)
def test_progress__the_handler_gets_the_value_error_and_nothing_is_written(fake_clock):
    job = _job(5, [[0, 1, "bad\nnote"]])
    assert run_delivery(job.pk, worker="w1").outcome == Attempt.Outcome.RETRY
    assert fake_clock == []
    job.refresh_from_db()
    assert job.progress_at is None and job.last_error_code == "ValueError"
