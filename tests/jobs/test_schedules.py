"""Periodic kinds (``jobs.schedules``): one job per tick whoever fires it, the catch-up
policy after downtime, cron in a time zone across daylight-saving changes, paused kinds,
the ``JOBS_SCHEDULES`` setting and its check, and ``manage.py jobs_schedules``.

Time is passed in (``fire_due(now=...)``), never slept on. The kinds are registered per
test and removed after it, so no other test's dispatcher round fires their ticks.
"""

from __future__ import annotations

import io
import json
import threading
from collections import Counter
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.core.management import call_command
from django.db import connection

from jobs import flow, registry, schedules
from jobs.delivery.runner import run_delivery
from jobs.models import Attempt, Job, ScheduleState
from jobs.schedules import ScheduleError, fire_due, make_schedule, parse_cron, tick_id

VIENNA = ZoneInfo("Europe/Vienna")
T0 = datetime(2027, 1, 4, 8, 0, 0, tzinfo=UTC)  # a Monday
SEEN: list[str] = []  # ticks the handler ran for


def _handler(ctx):
    SEEN.append(tick_id(schedules.tick_of(ctx.job)))
    return []


@pytest.fixture
def scheduled():
    """Register a periodic kind for this test only."""
    added: list[str] = []
    flow.forget()

    def add(name: str, schedule, **options) -> str:
        registry.register_kind(name, _handler, schedule=schedule, **options)
        added.append(name)
        return name

    yield add
    for name in added:
        registry._kinds.pop(name, None)
    flow.forget()
    SEEN.clear()


def _ticks(kind: str) -> list[str]:
    return sorted(Job.objects.filter(kind=kind).values_list("subject_id", flat=True))


def _iso(instant: datetime) -> str:
    return tick_id(instant)


# --- cron, no database --------------------------------------------------------------------


def test_parse_cron__fields_ranges_steps_names_and_aliases():
    cron = parse_cron("*/15 9-17/4 1,15 jan-mar mon-fri")
    assert cron.minutes == {0, 15, 30, 45}
    assert cron.hours == {9, 13, 17}
    assert cron.days == {1, 15} and cron.months == {1, 2, 3}
    assert cron.weekdays == {1, 2, 3, 4, 5}
    assert parse_cron("5/20 * * * 7").minutes == {5, 25, 45}
    assert parse_cron("0 0 * * 7").weekdays == {0}  # 7 is Sunday too
    daily, spelled = parse_cron("@daily"), parse_cron("0 0 * * *")
    assert (daily.minutes, daily.hours, daily.days) == (
        spelled.minutes,
        spelled.hours,
        spelled.days,
    )


@pytest.mark.parametrize(
    ("expression", "names"),
    [
        ("61 * * * *", "cron minute: 61 is outside 0-59"),
        ("* 24 * * *", "cron hour: 24"),
        ("* * 0 * *", "cron day of month: 0"),
        ("* * * 13 *", "cron month: 13"),
        ("* * * * 8", "cron day of week: 8"),
        ("* * * foo *", "cron month: 'foo'"),
        ("10-5 * * * *", "runs backwards"),
        ("*/0 * * * *", "at least 1"),
        ("* * * *", "5 fields"),
        ("0 0 30 2 *", "never fire"),
    ],
)
def test_parse_cron__a_bad_expression_names_its_field(expression, names):
    with pytest.raises(ScheduleError, match=names.replace("*", r"\*")):
        make_schedule("k", expression)


def test_cron__day_of_month_and_weekday_both_restricted_match_either():
    schedule = make_schedule("k", "0 9 1 * mon", tz="UTC")
    days, at = [], datetime(2027, 1, 1, tzinfo=UTC)
    for _ in range(5):
        at = schedule.next_after(at)
        days.append(at.date())
    # 1 Jan 2027 is a Friday: the 1st, then every Monday.
    assert days == [date(2027, 1, d) for d in (1, 4, 11, 18, 25)]


def test_cron__02_30_daily_in_vienna_across_spring_forward_and_fall_back():
    """What we chose: a skipped wall time fires at the end of the gap (03:00 CEST), once;
    a wall time shown twice fires once, at its first occurrence (02:30 CEST)."""
    schedule = make_schedule("k", "30 2 * * *", tz="Europe/Vienna")
    spring = schedule.ticks(
        datetime(2027, 3, 26, tzinfo=UTC), datetime(2027, 3, 30, 12, tzinfo=UTC), limit=10
    )
    assert [_iso(t) for t in spring] == [
        "2027-03-26T01:30:00Z",  # 02:30 CET
        "2027-03-27T01:30:00Z",  # 02:30 CET
        "2027-03-28T01:00:00Z",  # 02:30 does not exist: 03:00 CEST, the end of the gap
        "2027-03-29T00:30:00Z",  # 02:30 CEST
        "2027-03-30T00:30:00Z",
    ]
    autumn = schedule.ticks(
        datetime(2027, 10, 29, tzinfo=UTC), datetime(2027, 11, 1, 12, tzinfo=UTC), limit=10
    )
    assert [_iso(t) for t in autumn] == [
        "2027-10-29T00:30:00Z",  # 02:30 CEST
        "2027-10-30T00:30:00Z",
        "2027-10-31T00:30:00Z",  # 02:30 shown twice: the first (CEST), not 01:30Z (CET)
        "2027-11-01T01:30:00Z",  # 02:30 CET
    ]
    # Forward and backward searches agree, tick by tick.
    at, forward = datetime(2027, 3, 26, tzinfo=UTC), []
    while len(forward) < 5:
        at = schedule.next_after(at)
        forward.append(at)
    assert forward == spring


def test_cron__every_quarter_hour_through_the_gap_is_one_tick_at_its_end_in_order():
    schedule = make_schedule("k", "*/15 * * * *", tz="Europe/Vienna")
    ticks = schedule.ticks(
        datetime(2027, 3, 28, 0, 20, tzinfo=UTC), datetime(2027, 3, 28, 1, 30, tzinfo=UTC), limit=10
    )
    assert [t.astimezone(VIENNA).strftime("%H:%M%z") for t in ticks] == [
        "01:30+0100",
        "01:45+0100",
        "03:00+0200",  # 02:00, 02:15, 02:30, 02:45 and 03:00 all name this instant
        "03:15+0200",
        "03:30+0200",
    ]


def test_interval__ticks_are_multiples_of_the_interval_since_the_epoch():
    schedule = make_schedule("k", timedelta(seconds=10))
    at = datetime(2027, 1, 1, 0, 0, 5, tzinfo=UTC)
    assert _iso(schedule.next_after(at)) == "2027-01-01T00:00:10Z"
    assert _iso(schedule.latest_at(at)) == "2027-01-01T00:00:00Z"
    with pytest.raises(ScheduleError, match="whole number of seconds"):
        make_schedule("k", timedelta(milliseconds=1500))


def test_register_kind__refuses_a_catch_up_it_does_not_know_and_the_check_a_bad_cron():
    with pytest.raises(ValueError, match="catch_up must be one of latest, all"):
        registry.register_kind("test.bad_schedule", _handler, schedule="@daily", catch_up="skip")
    with pytest.raises(ValueError, match="cron string or a timedelta"):
        registry.register_kind("test.bad_schedule", _handler, schedule=300)
    assert "test.bad_schedule" not in registry.kinds()
    # The registry cannot import the parser (it is below it); the check reads the cron.
    registry.register_kind("test.bad_schedule", _handler, schedule="0 25 * * *")
    try:
        assert [m.msg for m in schedules.check_schedules(None)] == [
            "kind 'test.bad_schedule': cron hour: 25 is outside 0-23"
        ]
    finally:
        registry._kinds.pop("test.bad_schedule", None)


# --- firing -------------------------------------------------------------------------------

# Rounds of one dispatcher run in the test's transaction (cheap); the race and the
# delivery take real transactions.
in_transaction = pytest.mark.django_db
pytestmark_db = pytest.mark.django_db(transaction=True)


@pytestmark_db
def test_fire_due__a_new_schedule_starts_at_its_next_tick_then_one_job_per_tick(scheduled):
    kind = scheduled("test.every_minute", timedelta(minutes=1))
    assert fire_due(now=T0 + timedelta(seconds=30)) == []  # first sight: 08:00 is the start
    assert ScheduleState.objects.get(kind=kind).last_tick == T0
    assert fire_due(now=T0 + timedelta(seconds=50)) == []  # same period: nothing due
    handles = fire_due(now=T0 + timedelta(seconds=61))
    assert [(h.created, h.job.subject_type, h.job.subject_id) for h in handles] == [
        (True, "jobs.tick", "2027-01-04T08:01:00Z")
    ]
    assert handles[0].job.output_revision == 1 and handles[0].job.params == {}
    assert fire_due(now=T0 + timedelta(seconds=70)) == []  # asked once
    fire_due(now=T0 + timedelta(seconds=121))
    assert _ticks(kind) == ["2027-01-04T08:01:00Z", "2027-01-04T08:02:00Z"]
    # A stale state (another dispatcher's view) asks again and gets the same job back.
    ScheduleState.objects.filter(kind=kind).update(last_tick=T0 + timedelta(minutes=1))
    again = fire_due(now=T0 + timedelta(seconds=130))
    assert [(h.created, h.job.subject_id) for h in again] == [(False, "2027-01-04T08:02:00Z")]
    assert Job.objects.filter(kind=kind).count() == 2
    # The tick's job runs like any other, and its handler reads its tick.
    job = Job.objects.get(kind=kind, subject_id="2027-01-04T08:01:00Z")
    assert run_delivery(job.pk, worker="w-1").outcome == Attempt.Outcome.SUCCEEDED
    assert SEEN == ["2027-01-04T08:01:00Z"]


@in_transaction
def test_fire_due__a_round_with_nothing_due_is_one_query_per_kind_and_none_without_kinds(
    scheduled, django_assert_num_queries
):
    with django_assert_num_queries(0):
        assert fire_due() == []  # no periodic kind: not even the server's clock is read
    kind = scheduled("test.cheap_rounds", timedelta(minutes=1))
    fire_due(now=T0)
    flow.cached_rules()  # the flow rules' copy (read at most once a second)
    with django_assert_num_queries(1):  # the kind's state row
        assert fire_due(now=T0 + timedelta(seconds=30)) == []
    with pytest.raises(ValueError, match="aware"):
        fire_due(now=datetime(2027, 1, 4, 8, 0))
    assert ScheduleState.objects.get(kind=kind).last_tick == T0


@in_transaction
@pytest.mark.parametrize(
    ("catch_up", "expected"),
    [
        ("latest", ["2027-01-04T08:06:00Z"]),
        ("all", [f"2027-01-04T08:0{m}:00Z" for m in range(1, 7)]),
    ],
)
def test_fire_due__after_downtime_latest_asks_the_newest_tick_all_asks_each(
    scheduled, catch_up, expected
):
    kind = scheduled(f"test.catch_up_{catch_up}", timedelta(minutes=1), catch_up=catch_up)
    fire_due(now=T0)  # the schedule is known, last tick 08:00
    # The dispatchers (or the database) were away from 08:00:30 to 08:06:10: six ticks.
    handles = fire_due(now=T0 + timedelta(minutes=6, seconds=10))
    assert [h.job.subject_id for h in handles if h.created] == expected
    assert _ticks(kind) == expected
    assert ScheduleState.objects.get(kind=kind).last_tick == T0 + timedelta(minutes=6)
    assert fire_due(now=T0 + timedelta(minutes=6, seconds=20)) == []


@in_transaction
def test_fire_due__catch_up_all_is_bounded_to_the_newest_ticks(scheduled, monkeypatch):
    monkeypatch.setattr(schedules, "CATCH_UP_MAX", 4)
    kind = scheduled("test.catch_up_bounded", timedelta(seconds=10), catch_up="all")
    fire_due(now=T0)
    fire_due(now=T0 + timedelta(seconds=95))  # nine ticks missed
    assert _ticks(kind) == [f"2027-01-04T08:01:{s}0Z" for s in (0, 1, 2, 3)]


@in_transaction
def test_fire_due__a_paused_kind_gets_no_ticks_and_on_resume_its_catch_up_applies(scheduled):
    """What we chose: a paused kind's ticks are not created (the state does not move), so
    there is no pile of held ticks; resumed, the catch-up policy decides what it missed."""
    kind = scheduled("test.paused_ticks", timedelta(minutes=1), catch_up="latest")
    other = scheduled("test.unpaused_ticks", timedelta(minutes=1))
    fire_due(now=T0)
    flow.pause(f"kind:{kind}", actor="test")
    flow.forget()
    fire_due(now=T0 + timedelta(minutes=3, seconds=5))
    assert _ticks(kind) == [] and ScheduleState.objects.get(kind=kind).last_tick == T0
    assert _ticks(other) == ["2027-01-04T08:03:00Z"]  # pausing one kind holds only it
    flow.resume(f"kind:{kind}", actor="test")
    flow.forget()
    fire_due(now=T0 + timedelta(minutes=4, seconds=5))
    assert _ticks(kind) == ["2027-01-04T08:04:00Z"]


@in_transaction
def test_fire_due__cron_kind_in_its_time_zone(scheduled):
    kind = scheduled("test.nightly", "30 2 * * *", schedule_tz="Europe/Vienna", catch_up="all")
    fire_due(now=datetime(2027, 3, 26, 12, tzinfo=UTC))
    fire_due(now=datetime(2027, 3, 29, 12, tzinfo=UTC))  # away over the spring-forward night
    assert _ticks(kind) == [
        "2027-03-27T01:30:00Z",
        "2027-03-28T01:00:00Z",
        "2027-03-29T00:30:00Z",
    ]


@pytest.mark.postgres
@pytestmark_db
def test_fire_due__three_concurrent_dispatchers_make_exactly_one_job_per_tick(scheduled):
    """Three threads (three dispatchers, own connections) fire each period at once; the
    first round races on the state row too. The job's identity decides, no lock."""
    kind = scheduled("test.raced", timedelta(minutes=1), catch_up="all")
    rounds = [T0 + timedelta(seconds=5)] + [T0 + timedelta(minutes=m, seconds=1) for m in (1, 2)]
    rounds.append(T0 + timedelta(minutes=5, seconds=1))  # and a catch-up of three ticks
    barrier = threading.Barrier(3)
    created: Counter = Counter()
    errors: list[BaseException] = []

    def dispatcher() -> None:
        try:
            for now in rounds:
                barrier.wait(30)
                for handle in fire_due(now=now):
                    if handle.created:
                        created[handle.job.subject_id] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)
            barrier.abort()
        finally:
            connection.close()

    threads = [threading.Thread(target=dispatcher) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    expected = [f"2027-01-04T08:0{m}:00Z" for m in range(1, 6)]
    assert _ticks(kind) == expected
    assert created == dict.fromkeys(expected, 1)  # each tick created by one of the three
    assert ScheduleState.objects.filter(kind=kind).count() == 1


# --- the setting, its check, the command --------------------------------------------------


@in_transaction
def test_jobs_schedules_setting__schedules_a_kind_declared_elsewhere_and_wins(scheduled, settings):
    registry.register_kind("test.declared_elsewhere", _handler)
    try:
        own = scheduled("test.own_schedule", timedelta(minutes=10))
        settings.JOBS_SCHEDULES = {
            "test.declared_elsewhere": {"every": 60, "catch_up": "all"},
            own: {"cron": "*/1 * * * *", "tz": "Europe/Vienna"},
        }
        found, problems = schedules.collect()
        assert problems == []
        assert found["test.declared_elsewhere"].every == timedelta(seconds=60)
        assert found[own].describe() == "*/1 * * * *" and found[own].source == "JOBS_SCHEDULES"
        fire_due(now=T0)
        fire_due(now=T0 + timedelta(minutes=2, seconds=1))
        assert _ticks("test.declared_elsewhere") == [
            "2027-01-04T08:01:00Z",
            "2027-01-04T08:02:00Z",
        ]
        assert _ticks(own) == ["2027-01-04T08:02:00Z"]  # every minute, latest
    finally:
        registry._kinds.pop("test.declared_elsewhere", None)


def test_check_schedules__names_the_bad_key(settings):
    registry.register_kind("test.check_target", _handler)
    try:
        settings.JOBS_SCHEDULES = {
            "test.nowhere": {"every": 60},
            "test.check_target": {"cron": "0 2 * *", "tz": "Mars/Olympus", "catch_up": "all"},
        }
        messages = schedules.check_schedules(None)
        assert {m.id for m in messages} == {"jobs.E040"}
        text = [m.msg for m in messages]
        assert text[0] == ("JOBS_SCHEDULES['test.nowhere']: no job kind of that name is registered")
        assert text[1].startswith("JOBS_SCHEDULES['test.check_target']['tz']: 'Mars/Olympus'")
        settings.JOBS_SCHEDULES = {"test.check_target": {"cron": "0 2 * *"}}
        assert [m.msg for m in schedules.check_schedules(None)] == [
            "JOBS_SCHEDULES['test.check_target']['cron']: a cron expression has 5 fields "
            "(minute hour day month weekday), not 4: '0 2 * *'"
        ]
        settings.JOBS_SCHEDULES = {"test.check_target": {"cron": "@daily", "catch_up": "skip"}}
        assert "['catch_up']: one of latest, all" in schedules.check_schedules(None)[0].msg
        settings.JOBS_SCHEDULES = {"test.check_target": {"every": 5, "at": "02:00"}}
        assert "['at']: unknown key" in schedules.check_schedules(None)[0].msg
        settings.JOBS_SCHEDULES = {"test.check_target": {"every": 5, "cron": "@daily"}}
        assert "exactly one of 'cron' and 'every'" in schedules.check_schedules(None)[0].msg
        settings.JOBS_SCHEDULES = {"test.check_target": {"every": 60, "tz": "Europe/Vienna"}}
        assert schedules.check_schedules(None) == []
    finally:
        registry._kinds.pop("test.check_target", None)


@in_transaction
def test_jobs_schedules_command__lists_each_schedule_with_last_and_next_tick(scheduled):
    nightly = scheduled("test.cmd_nightly", "30 2 * * *", schedule_tz="Europe/Vienna")
    minutely = scheduled("test.cmd_minutely", timedelta(minutes=1), catch_up="all")
    fire_due(now=datetime(2027, 3, 27, 12, tzinfo=UTC))
    flow.pause(f"kind:{minutely}", actor="test")
    flow.forget()
    out = io.StringIO()
    call_command("jobs_schedules", stdout=out)
    lines = out.getvalue().splitlines()
    print(out.getvalue())
    assert lines[0].split() == [
        "kind", "schedule", "time", "zone", "catch-up", "last", "tick", "next", "tick", "paused"
    ]  # fmt: skip
    row = next(line for line in lines if line.startswith(nightly))
    assert "30 2 * * *" in row and "Europe/Vienna" in row and "latest" in row
    assert "2027-03-27 02:30:00 CET (2027-03-27T01:30:00Z)" in row  # the last tick
    assert "2027-03-28 03:00:00 CEST (2027-03-28T01:00:00Z)" in row  # the next: the gap's end
    assert row.rstrip().endswith("no")
    paused = next(line for line in lines if line.startswith(minutely))
    assert "every 60 s" in paused and "all" in paused and "paused" in paused
    assert paused.rstrip().endswith("yes")
    out = io.StringIO()
    call_command("jobs_schedules", "--json", stdout=out)
    rows = {r["kind"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert rows[nightly]["next_tick"] == "2027-03-28T01:00:00Z"
    assert rows[minutely]["paused"] is True and rows[minutely]["last_tick"] == (
        "2027-03-27T12:00:00Z"
    )


def test_console__lists_each_schedule_with_its_ticks_and_pause(scheduled, admin_client):
    nightly = scheduled("test.console_nightly", "30 2 * * *", schedule_tz="Europe/Vienna")
    minutely = scheduled("test.console_minutely", timedelta(minutes=1))
    fire_due(now=datetime(2027, 3, 27, 12, tzinfo=UTC))
    flow.pause(f"kind:{minutely}", actor="test")
    flow.forget()
    page = admin_client.get("/admin/jobs/job/dashboard/").content.decode()
    table = page.split('id="schedules"')[1].split("</table>")[0]
    nightly_row = table.split(f'data-schedule="{nightly}"')[1].split("</tr>")[0]
    assert "30 2 * * *" in nightly_row and "Europe/Vienna" in nightly_row
    assert "2027-03-27 01:30 UTC" in nightly_row  # the last tick requested
    assert "2027-03-28 01:00 UTC" in nightly_row  # the next: the end of the DST gap
    assert nightly_row.rstrip().endswith("<td>no</td>")
    paused_row = table.split(f'data-schedule="{minutely}"')[1].split("</tr>")[0]
    assert paused_row.rstrip().endswith("<td>yes</td>")
