"""Run the dispatcher in a loop (finer-grained than a django-q2 schedule)."""

from __future__ import annotations

import signal
import time

from django.core.management.base import BaseCommand
from django.db import close_old_connections

from jobs.dispatch import dispatch_once


class Command(BaseCommand):
    help = "Enqueue due retries, reclaim expired leases and re-drive stuck effects, in a loop."

    def add_arguments(self, parser):
        parser.add_argument("--interval", type=float, default=1.0, help="seconds between sweeps")
        parser.add_argument("--once", action="store_true", help="one sweep, then exit")

    def handle(self, *args, interval: float, once: bool, **options):
        stopping = False

        def stop(*_):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        while True:
            close_old_connections()
            sent = dispatch_once()
            if once:
                self.stdout.write(" ".join(f"{k}={v}" for k, v in sent.items()))
                return
            if stopping:
                return
            time.sleep(interval)
            if stopping:
                return
