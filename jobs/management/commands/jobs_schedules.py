"""List the periodic kinds: expression, time zone, catch-up, last and next tick, paused."""

from __future__ import annotations

import json
from datetime import datetime

from django.core.management.base import BaseCommand

from jobs import schedules

COLUMNS = ("kind", "schedule", "time zone", "catch-up", "last tick", "next tick", "paused")


def _when(instant: datetime | None, zone) -> str:
    """A tick in the schedule's own zone, with its UTC time: what an operator compares."""
    if instant is None:
        return "-"
    local = instant.astimezone(zone)
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname()} ({schedules.tick_id(instant)})"


class Command(BaseCommand):
    help = (
        "Each periodic kind (jobs.kind(schedule=...) or JOBS_SCHEDULES): its cron expression "
        "or interval, time zone, catch-up policy, the last tick requested, the next tick, "
        "and whether flow control pauses it (a paused kind gets no ticks)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="one JSON object per schedule")

    def handle(self, *args, **options):
        rows, problems = schedules.overview()
        if options["json"]:
            return self._json(rows, problems)
        if not rows:
            self.stdout.write("no periodic kinds")
        table = [COLUMNS]
        for row in rows:
            zone = schedules.zone(row.tz)
            table.append(
                (
                    row.kind,
                    row.schedule,
                    row.tz,
                    row.catch_up,
                    _when(row.last_tick, zone),
                    "paused" if row.paused else _when(row.next_tick, zone),
                    "yes" if row.paused else "no",
                )
            )
        if rows:
            widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
            for line in table:
                cells = (v.ljust(w) for v, w in zip(line, widths, strict=True))
                self.stdout.write("  ".join(cells).rstrip())
        for where, message in problems:
            self.stderr.write(f"not read: {where}: {message}")

    def _json(self, rows, problems) -> None:
        for row in rows:
            self.stdout.write(
                json.dumps(
                    {
                        "kind": row.kind,
                        "schedule": row.schedule,
                        "tz": row.tz,
                        "catch_up": row.catch_up,
                        "source": row.source,
                        "last_tick": row.last_tick and schedules.tick_id(row.last_tick),
                        "next_tick": row.next_tick and schedules.tick_id(row.next_tick),
                        "paused": row.paused,
                    }
                )
            )
        for where, message in problems:
            self.stderr.write(f"not read: {where}: {message}")
