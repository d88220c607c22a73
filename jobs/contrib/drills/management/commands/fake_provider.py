"""Serve the stand-in notice provider on loopback (see ``jobs.testing.fakeprovider``)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from jobs.testing.fakeprovider import FakeProviderServer, Faults


def _window(value: str) -> tuple[float, float]:
    try:
        start, end = (float(part) for part in value.split(":", 1))
    except ValueError:
        raise CommandError(f"--down-window takes START:END in seconds, got {value!r}") from None
    if end <= start:
        raise CommandError(f"--down-window {value!r}: END must be after START")
    return start, end


def _fraction(value: str) -> float:
    f = float(value)
    if not 0 <= f <= 1:
        raise CommandError(f"a fraction must be between 0 and 1, got {value}")
    return f


class Command(BaseCommand):
    help = (
        "Serve the notice provider protocol on loopback, recording every request and "
        "applied send in its own SQLite file. SIGUSR1 takes it down (connections "
        "refused), SIGUSR2 brings it back; SIGTERM/SIGINT stop it."
    )
    requires_system_checks: list = []

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8025, help="0 picks a free port")
        parser.add_argument("--host", default="127.0.0.1", help="loopback only by default")
        parser.add_argument(
            "--record",
            default=None,
            help="SQLite file for the provider's own record (default: a new temp file)",
        )
        parser.add_argument(
            "--token",
            default=os.environ.get("FAKE_PROVIDER_TOKEN", ""),
            help="bearer token to require (default: $FAKE_PROVIDER_TOKEN; empty: any)",
        )
        parser.add_argument(
            "--stall",
            type=_fraction,
            default=0.0,
            help="fraction of new sends applied, then left unanswered past the client timeout",
        )
        parser.add_argument("--stall-seconds", type=float, default=30.0)
        parser.add_argument(
            "--unavailable", type=_fraction, default=0.0, help="fraction answered 503"
        )
        parser.add_argument("--retry-after", type=float, default=1.0, help="seconds, with 503")
        parser.add_argument(
            "--reject", type=_fraction, default=0.0, help="fraction answered --reject-status"
        )
        parser.add_argument("--reject-status", type=int, default=422)
        parser.add_argument(
            "--lookup-unavailable",
            type=_fraction,
            default=0.0,
            help="fraction of lookups (GET /notices/KEY) answered 503",
        )
        parser.add_argument(
            "--no-lookup", action="store_true", help="answer lookups 405 (no such capability)"
        )
        parser.add_argument("--delay", type=float, default=0.0, help="latency of every answer")
        parser.add_argument(
            "--down-window",
            type=_window,
            action="append",
            default=[],
            help="START:END seconds after start during which connections are refused (repeatable)",
        )
        parser.add_argument("--start-down", action="store_true", help="refuse until SIGUSR2")
        parser.add_argument("--seed", type=int, default=None, help="seed the fault dice")
        parser.add_argument(
            "--error-after", type=int, default=0, help="sends before the error window starts"
        )
        parser.add_argument(
            "--error-seconds", type=float, default=0.0, help="seconds every send is answered 500"
        )

    def handle(self, *args, **opts):
        if opts["host"] not in ("127.0.0.1", "::1", "localhost"):
            self.stderr.write("warning: serving beyond loopback; this is a test stand-in")
        record = opts["record"] or tempfile.mkstemp(prefix="fake-provider-", suffix=".sqlite3")[1]
        faults = Faults(
            stall=opts["stall"],
            stall_seconds=opts["stall_seconds"],
            unavailable=opts["unavailable"],
            retry_after=opts["retry_after"],
            reject=opts["reject"],
            reject_status=opts["reject_status"],
            lookup_unavailable=opts["lookup_unavailable"],
            no_lookup=opts["no_lookup"],
            delay=opts["delay"],
            down=opts["down_window"],
            seed=opts["seed"],
            error_after=opts["error_after"],
            error_seconds=opts["error_seconds"],
        )
        try:
            server = FakeProviderServer(
                (opts["host"], opts["port"]),
                record_path=Path(record),
                faults=faults,
                token=opts["token"],
                start_down=opts["start_down"],
            )
        except OSError as exc:
            raise CommandError(f"cannot listen on {opts['host']}:{opts['port']}: {exc}") from exc

        def stop(*_):
            server.stopping.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGUSR1, lambda *_: server.set_down(True))
        signal.signal(signal.SIGUSR2, lambda *_: server.set_down(False))
        # The first line is machine-readable: the burst drill parses the port from it.
        self.stdout.write(f"fake provider listening on {server.url} record={record}")
        sys.stdout.flush()
        try:
            server.serve_forever()
        finally:
            server.stop()
            self.stdout.write("fake provider stopped")
