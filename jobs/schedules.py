"""Periodic kinds: each tick of a schedule is one job, requested by whichever dispatcher
gets there first.

A schedule is a 5-field cron expression read in a time zone, or an interval
(``timedelta``). A tick's job has the identity (kind, ``jobs.tick``, the tick's UTC time
in ISO form, revision 1), asked for through ``jobs.request_many``: two dispatchers that
both see a tick due ask for the same identity, and the unique constraint on the job's
identity lets one row exist. No host holds a lock for it.

``fire_due`` remembers the last tick it requested per kind in ``ScheduleState``, moved
forward by compare-and-swap (``last_tick < new``). That row is bookkeeping, not the
guarantee: a dispatcher that read it stale asks again for ticks that exist, and gets
their handles back (``created`` False). After downtime the kind's ``catch_up`` decides:
``"latest"`` requests only the newest missed tick, ``"all"`` every missed tick, at most
``CATCH_UP_MAX`` (the newest ones). A paused kind (flow rule ``kind:<name>``) gets no
ticks and its state does not move; when it resumes, its ticks missed meanwhile follow
the same catch-up policy.

Cron in a time zone, across a daylight-saving change: a wall time the clock skips
(02:30 on spring-forward day in Europe/Vienna) fires at the first instant after the gap
(03:00 local, once, however many skipped times matched); a wall time the clock shows
twice (02:30 on fall-back day) fires once, at its first occurrence. Ticks are taken by
the database server's clock, like every due time of the app.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.core import checks

from jobs.clock import server_now
from jobs.registry import CATCH_UP

if TYPE_CHECKING:
    from jobs.api import JobHandle

log = logging.getLogger("jobs.schedules")

CATCH_UP_MAX = 100  # ticks one "all" catch-up requests at most: the newest ones
SUBJECT_TYPE = "jobs.tick"
SETTING = "JOBS_SCHEDULES"
SETTING_KEYS = ("cron", "every", "tz", "catch_up")
# A cron expression that matches no date within this many days never fires (Feb 30);
# a Feb 29 one matches at most 8 years apart (2096 -> 2104).
SEARCH_DAYS = 9 * 366
# Daylight-saving shifts are at most two hours: a search for the tick next to an instant
# starts this far to the other side of its wall time.
_SLACK = timedelta(hours=3)
_MINUTE = timedelta(minutes=1)
_TICK_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


class ScheduleError(ValueError):
    """Raised when a schedule is not a cron expression, an interval, a time zone or a
    catch-up policy the app reads."""


# --- cron ---------------------------------------------------------------------------------

_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
# name, lowest, highest, names (their index + offset is the value)
_FIELDS = (
    ("minute", 0, 59, None, 0),
    ("hour", 0, 23, None, 0),
    ("day of month", 1, 31, None, 0),
    ("month", 1, 12, _MONTHS, 1),
    ("day of week", 0, 7, _DAYS, 0),
)
_ITEM = re.compile(r"(\*|\w+)(?:-(\w+))?(?:/(\d+))?")


@dataclass(frozen=True)
class Cron:
    """A parsed 5-field cron expression: the values each field matches.

    Day of month and day of week follow Vixie cron: when both are restricted (neither
    starts with ``*``), a day matching either one matches.
    """

    expression: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool
    any_weekday: bool

    def day_matches(self, day: date) -> bool:
        """Whether the expression runs on ``day`` at all."""
        in_month = day.day in self.days
        in_week = (day.weekday() + 1) % 7 in self.weekdays
        if self.any_day and self.any_weekday:
            return True
        if self.any_day:
            return in_week
        if self.any_weekday:
            return in_month
        return in_month or in_week


def _value(text: str, field: str, low: int, high: int, names: list[str] | None, offset: int):
    if text.isdigit():
        value = int(text)
    elif names and text.lower() in names:
        value = names.index(text.lower()) + offset
    else:
        raise ScheduleError(f"cron {field}: {text[:20]!r} is not a number from {low} to {high}")
    if not low <= value <= high:
        raise ScheduleError(f"cron {field}: {value} is outside {low}-{high}")
    return value


def _field(text: str, field: str, low: int, high: int, names, offset: int) -> frozenset[int]:
    values: set[int] = set()
    for item in text.split(","):
        match = _ITEM.fullmatch(item)
        if not match:
            raise ScheduleError(f"cron {field}: {item[:20]!r} is not a value, range or step")
        start, end, step = match.groups()
        if start == "*":
            if end is not None:
                raise ScheduleError(f"cron {field}: '*' cannot start a range")
            first, last = low, high
        else:
            first = _value(start, field, low, high, names, offset)
            last = _value(end, field, low, high, names, offset) if end else first
            if end is None and step is not None:
                last = high  # "5/15": from 5 to the end, every 15
        if first > last:
            raise ScheduleError(f"cron {field}: the range {item!r} runs backwards")
        stride = int(step) if step is not None else 1
        if stride < 1:
            raise ScheduleError(f"cron {field}: a step must be at least 1")
        values.update(range(first, last + 1, stride))
    return frozenset(values)


@functools.lru_cache(maxsize=256)
def parse_cron(expression: str) -> Cron:
    """Parse ``minute hour day-of-month month day-of-week`` (or ``@daily`` and the like)."""
    if not isinstance(expression, str):
        raise ScheduleError(f"a cron expression is a string, not {type(expression).__name__}")
    text = _ALIASES.get(expression.strip().lower(), expression)
    parts = text.split()
    if len(parts) != 5:
        raise ScheduleError(
            f"a cron expression has 5 fields (minute hour day month weekday), "
            f"not {len(parts)}: {expression[:60]!r}"
        )
    minutes, hours, days, months, weekdays = (
        _field(part, *spec) for part, spec in zip(parts, _FIELDS, strict=True)
    )
    return Cron(
        expression=expression.strip(),
        minutes=minutes,
        hours=hours,
        days=days,
        months=months,
        weekdays=frozenset(d % 7 for d in weekdays),  # 7 is Sunday too
        any_day=parts[2].startswith("*"),
        any_weekday=parts[4].startswith("*"),
    )


def _walls_up(cron: Cron, wall: datetime) -> Iterator[datetime]:
    """The wall times (naive, local) the expression matches, from ``wall`` on, ascending."""
    end = wall + timedelta(days=SEARCH_DAYS)
    while wall < end:
        if wall.month not in cron.months:
            year, month = wall.year + (wall.month == 12), wall.month % 12 + 1
            wall = datetime(year, month, 1)
        elif not cron.day_matches(wall.date()):
            wall = datetime.combine(wall.date() + timedelta(days=1), time())
        elif wall.hour not in cron.hours:
            wall = wall.replace(minute=0) + timedelta(hours=1)
        elif wall.minute not in cron.minutes:
            wall += _MINUTE
        else:
            yield wall
            wall += _MINUTE


def _walls_down(cron: Cron, wall: datetime) -> Iterator[datetime]:
    """The wall times the expression matches, from ``wall`` back, descending."""
    end = wall - timedelta(days=SEARCH_DAYS)
    while wall > end:
        if wall.month not in cron.months:
            wall = datetime(wall.year, wall.month, 1) - _MINUTE
        elif not cron.day_matches(wall.date()):
            wall = datetime.combine(wall.date(), time()) - _MINUTE
        elif wall.hour not in cron.hours:
            wall = wall.replace(minute=0) - _MINUTE
        elif wall.minute not in cron.minutes:
            wall -= _MINUTE
        else:
            yield wall
            wall -= _MINUTE


def wall_to_utc(wall: datetime, tz: ZoneInfo) -> datetime:
    """The instant a local wall time names: its first occurrence when the clock shows it
    twice, the end of the gap when the clock skips it. Never decreases as ``wall`` grows,
    so the ticks of a day keep their order across a change."""
    first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if first.astimezone(tz).replace(tzinfo=None) == wall:
        return first
    # In a gap: fold=0 read it with the offset before the change (an instant after it),
    # fold=1 with the one after (an instant before it). The change lies between.
    low, high = wall.replace(tzinfo=tz, fold=1).astimezone(UTC), first
    after = high.astimezone(tz).utcoffset()
    while high - low > _MINUTE:
        mid = low + (high - low) // 2
        mid = mid.replace(second=0, microsecond=0)
        if mid <= low:
            mid = low + _MINUTE
        if mid.astimezone(tz).utcoffset() == after:
            high = mid
        else:
            low = mid
    return high


# --- a schedule ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """One periodic kind's schedule: a cron expression in ``tz``, or an interval."""

    kind: str
    cron: Cron | None
    every: timedelta | None
    tz: ZoneInfo
    catch_up: str
    source: str  # "jobs.kind" or "JOBS_SCHEDULES"

    def describe(self) -> str:
        """The expression as an operator wrote it, or ``every 300 s``."""
        if self.cron is not None:
            return self.cron.expression
        return f"every {int(self.every.total_seconds())} s"

    def next_after(self, instant: datetime) -> datetime | None:
        """The first tick strictly after ``instant`` (None: the expression never fires)."""
        if self.every is not None:
            step = int(self.every.total_seconds())
            return _epoch((int(instant.timestamp()) // step + 1) * step)
        start = instant.astimezone(self.tz).replace(tzinfo=None, second=0, microsecond=0)
        for wall in _walls_up(self.cron, start - _SLACK):
            tick = wall_to_utc(wall, self.tz)
            if tick > instant:
                return tick
        return None

    def latest_at(self, instant: datetime) -> datetime | None:
        """The last tick at or before ``instant`` (None: none within the search window)."""
        return next(self._down(instant), None)

    def ticks(self, after: datetime, upto: datetime, *, limit: int) -> list[datetime]:
        """The newest ``limit`` ticks in (``after``, ``upto``], oldest first."""
        found: list[datetime] = []
        for tick in self._down(upto):
            if tick <= after or len(found) >= limit:
                break
            found.append(tick)
        return found[::-1]

    def _down(self, instant: datetime) -> Iterator[datetime]:
        """Ticks at or before ``instant``, newest first, each once."""
        if self.every is not None:
            step = int(self.every.total_seconds())
            n = int(instant.timestamp()) // step
            while True:
                yield _epoch(n * step)
                n -= 1
        start = instant.astimezone(self.tz).replace(tzinfo=None, second=0, microsecond=0)
        last = None
        for wall in _walls_down(self.cron, start + _SLACK):
            tick = wall_to_utc(wall, self.tz)
            if tick <= instant and tick != last:  # a gap's wall times share one tick
                last = tick
                yield tick


def _epoch(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def tick_id(tick: datetime) -> str:
    """The subject id of a tick's job: its UTC time, ``2026-12-01T02:00:00Z``."""
    return tick.astimezone(UTC).strftime(_TICK_FORMAT)


def tick_of(job: Any) -> datetime:
    """The tick a periodic kind's job runs for (a handler reads ``tick_of(ctx.job)``)."""
    return datetime.strptime(job.subject_id, _TICK_FORMAT).replace(tzinfo=UTC)


def zone(name: str | None) -> ZoneInfo:
    """The named IANA time zone (None: TIME_ZONE); ScheduleError when there is none."""
    from django.conf import settings

    name = name or settings.TIME_ZONE or "UTC"
    try:
        return ZoneInfo(str(name))
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(f"{str(name)[:60]!r} is not a time zone (IANA name)") from None


def make_schedule(
    kind: str,
    schedule: str | timedelta,
    *,
    tz: str | None = None,
    catch_up: str = "latest",
    source: str = "jobs.kind",
) -> Schedule:
    """A ``Schedule`` from a kind's declaration; ``ScheduleError`` naming what is wrong."""
    if catch_up not in CATCH_UP:
        raise ScheduleError(f"catch_up must be one of {', '.join(CATCH_UP)}, not {catch_up!r}")
    cron = every = None
    if isinstance(schedule, timedelta):
        seconds = schedule.total_seconds()
        if seconds < 1 or not seconds.is_integer():
            raise ScheduleError(f"an interval is a whole number of seconds, at least 1: {schedule}")
        every = schedule
    elif isinstance(schedule, str):
        cron = parse_cron(schedule)
    else:
        raise ScheduleError(
            f"a schedule is a cron expression (str) or an interval (timedelta), "
            f"not {type(schedule).__name__}"
        )
    made = Schedule(kind, cron, every, zone(tz), catch_up, source)
    if cron is not None and made.next_after(datetime(2000, 1, 1, tzinfo=UTC)) is None:
        raise ScheduleError(f"cron {schedule!r} matches no date: it would never fire")
    return made


def _from_setting(kind: str, entry: object) -> Schedule:
    if not isinstance(entry, dict):
        raise ScheduleError("must be a dict with 'cron' or 'every'", "")
    unknown = sorted(set(entry) - set(SETTING_KEYS))
    if unknown:
        raise ScheduleError(f"unknown key (known: {', '.join(SETTING_KEYS)})", unknown[0])
    if ("cron" in entry) == ("every" in entry):
        raise ScheduleError("needs exactly one of 'cron' and 'every'", "")
    if "every" in entry:
        every = entry["every"]
        if isinstance(every, int | float) and not isinstance(every, bool):
            every = timedelta(seconds=every)
        if not isinstance(every, timedelta):
            raise ScheduleError("a number of seconds or a timedelta", "every")
        spec, key = every, "every"
    else:
        spec, key = entry["cron"], "cron"
    for name, value in (("tz", entry.get("tz")), ("catch_up", entry.get("catch_up", "latest"))):
        try:
            if name == "tz":
                zone(value)
            elif value not in CATCH_UP:
                raise ScheduleError(f"one of {', '.join(CATCH_UP)}, not {str(value)[:20]!r}")
        except ScheduleError as exc:
            raise ScheduleError(str(exc), name) from None
    try:
        return make_schedule(
            kind,
            spec,
            tz=entry.get("tz"),
            catch_up=entry.get("catch_up", "latest"),
            source=SETTING,
        )
    except ScheduleError as exc:
        raise ScheduleError(str(exc), key) from None


def collect() -> tuple[dict[str, Schedule], list[tuple[str, str]]]:
    """Every periodic kind's schedule, and the problems: (where, what) per bad entry.

    ``JOBS_SCHEDULES`` (kind name -> ``{"cron"|"every", "tz", "catch_up"}``) schedules
    kinds declared elsewhere, and wins over a kind's own ``schedule=``.
    """
    from jobs import conf, registry

    found: dict[str, Schedule] = {}
    problems: list[tuple[str, str]] = []
    known = registry.kinds()
    for name, kind in known.items():
        if kind.schedule is None:
            continue
        try:
            found[name] = make_schedule(
                name, kind.schedule, tz=kind.schedule_tz, catch_up=kind.catch_up
            )
        except ScheduleError as exc:
            problems.append((f"kind {name!r}", str(exc)))
    entries = conf.get(SETTING) or {}
    if not isinstance(entries, dict):
        return found, [*problems, (SETTING, "must be a dict: kind name -> schedule")]
    for name, entry in entries.items():
        where = f"{SETTING}[{name!r}]"
        if name not in known:
            problems.append((where, "no job kind of that name is registered"))
            continue
        try:
            found[name] = _from_setting(name, entry)
        except ScheduleError as exc:
            message, *key = exc.args
            problems.append((f"{where}[{key[0]!r}]" if key and key[0] else where, message))
    return found, problems


def check_schedules(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """A schedule that cannot be read would silently never fire: refuse to start."""
    return [
        checks.Error(
            f"{where}: {message}",
            hint="See docs/app/schedules.md: a 5-field cron expression or an interval "
            "('every' seconds), an IANA time zone, catch_up 'latest' or 'all'.",
            id="jobs.E040",
        )
        for where, message in collect()[1]
    ]


# --- firing -------------------------------------------------------------------------------


def is_paused(kind: str) -> bool:
    """Whether flow control pauses the kind (``jobs_limits pause kind:<name>``)."""
    from jobs import flow

    rule = flow.cached_rules().get(f"kind:{kind}")
    return bool(rule is not None and rule.paused)


_warned: set[tuple[str, str]] = set()


def fire_due(now: datetime | None = None) -> list[JobHandle]:
    """Request every tick due since the last one requested, per periodic kind.

    Returns the handles of the ticks asked for this call (``created`` is True for those
    this call inserted). Safe to run on every dispatcher at once: a tick is one job
    identity. A kind seen for the first time starts at its latest tick (no job for it):
    a new schedule fires from its next tick on.
    """
    from django.db import DatabaseError
    from django.utils import timezone

    if now is not None and timezone.is_naive(now):
        raise ValueError("now must be an aware datetime")
    schedules, problems = collect()
    for problem in problems:
        if problem not in _warned:  # once per process: the check names it at start-up
            _warned.add(problem)
            log.warning("schedule not read: %s: %s", *problem)
    if not schedules:
        return []  # no periodic kinds: no query
    now = now or server_now()
    handles: list[JobHandle] = []
    for schedule in schedules.values():
        try:
            handles.extend(fire_kind(schedule, now))
        except DatabaseError:
            raise
        except Exception:  # one kind's bug must not stop the others' ticks
            log.exception("ticks of %s not requested this round", schedule.kind)
    return handles


def fire_kind(schedule: Schedule, now: datetime) -> list[JobHandle]:
    """Request the due ticks of one schedule (see ``fire_due``)."""
    from django.utils import timezone

    from jobs.api import JobRequest, request_many
    from jobs.models import ScheduleState

    if is_paused(schedule.kind):
        return []
    state, created = ScheduleState.objects.get_or_create(
        kind=schedule.kind,
        defaults={"last_tick": schedule.latest_at(now) or now, "updated_at": timezone.now()},
    )
    if created:
        return []
    limit = 1 if schedule.catch_up == "latest" else CATCH_UP_MAX
    due = schedule.ticks(state.last_tick, now, limit=limit)
    if not due:
        return []
    handles = request_many(
        JobRequest(schedule.kind, (SUBJECT_TYPE, tick_id(tick)), revision=1) for tick in due
    )
    ScheduleState.objects.filter(kind=schedule.kind, last_tick__lt=due[-1]).update(
        last_tick=due[-1], updated_at=timezone.now()
    )
    fresh = [tick_id(tick) for tick, h in zip(due, handles, strict=True) if h.created]
    if fresh:  # which dispatcher created which tick: the drill reads it
        shown = " ".join(fresh) if len(fresh) <= 5 else f"{fresh[0]} .. {fresh[-1]} ({len(fresh)})"
        log.info("schedule %s: created tick(s) %s", schedule.kind, shown)
    return handles


@dataclass(frozen=True)
class Row:
    """One line of ``manage.py jobs_schedules``."""

    kind: str
    schedule: str
    tz: str
    catch_up: str
    source: str
    last_tick: datetime | None
    next_tick: datetime | None
    paused: bool


def overview(now: datetime | None = None) -> tuple[list[Row], list[tuple[str, str]]]:
    """Each schedule with its last requested and next tick, and the unreadable entries."""
    from jobs.models import ScheduleState

    now = now or server_now()
    schedules, problems = collect()
    last = dict(ScheduleState.objects.values_list("kind", "last_tick"))
    rows = []
    for name in sorted(schedules):
        schedule = schedules[name]
        previous = last.get(name)
        rows.append(
            Row(
                kind=name,
                schedule=schedule.describe(),
                tz=str(schedule.tz.key) if schedule.cron is not None else "UTC",
                catch_up=schedule.catch_up,
                source=schedule.source,
                last_tick=previous,
                next_tick=schedule.next_after(previous or now),
                paused=is_paused(name),
            )
        )
    return rows, problems
