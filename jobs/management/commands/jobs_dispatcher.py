"""Run the dispatcher in a loop (finer-grained than a django-q2 schedule).

The loop outlives the database: a sweep that fails on a connection error (refused,
reset, server restarting, too many clients) closes the broken connection and is
tried again with capped backoff; the outage is logged once when it begins and once,
with its length, when it ends. The database may also be down when the loop starts.
"""

from __future__ import annotations

import logging
import signal

from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections

from jobs.dispatch import dispatch_once
from jobs.supervisor import DATABASE_ERRORS, Outage, describe, pause

log = logging.getLogger("jobs.dispatch")


class Command(BaseCommand):
    help = "Enqueue due retries, reclaim expired leases and re-drive stuck effects, in a loop."

    def add_arguments(self, parser):
        parser.add_argument("--interval", type=float, default=1.0, help="seconds between sweeps")
        parser.add_argument("--once", action="store_true", help="one sweep, then exit")
        parser.add_argument(
            "--max-backoff",
            type=float,
            default=5.0,
            help="longest wait between tries while the database is unavailable (default 5)",
        )

    def handle(self, *args, interval: float, once: bool, max_backoff: float, **options):
        stopping = False

        def stop(*_):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        outage = Outage("jobs_dispatcher", cap=max_backoff)
        started = False
        while not stopping:
            try:
                close_old_connections()  # CONN_MAX_AGE and health checks, as a request would
                sent = dispatch_once()
            except DATABASE_ERRORS as exc:
                if once:
                    raise CommandError(f"database unavailable: {describe(exc)}") from None
                pause(outage.failed(exc), lambda: stopping)
                continue
            outage.recovered()
            if not started:  # once, so an operator (and the soak) sees it is at work
                log.info("jobs_dispatcher: sweeping every %s s", interval)
                started = True
            if once:
                self.stdout.write(" ".join(f"{k}={v}" for k, v in sent.items()))
                return
            pause(interval, lambda: stopping)
