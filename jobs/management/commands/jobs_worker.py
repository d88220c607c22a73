"""The supervised worker: ``manage.py qcluster`` kept running through outages and wedges."""

from __future__ import annotations

import argparse

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from jobs.registry import check_queue
from jobs.supervisor import PING_TIMEOUT, Options, Supervisor, serve_queues


def default_stall_seconds() -> float:
    """Halfway between Q_CLUSTER timeout and retry.

    Above the timeout, so one long delivery never looks like a stall; below the
    retry, so a message held by a wedged cluster is seen before it is handed out again.
    """
    q = getattr(settings, "Q_CLUSTER", {})
    timeout, retry = float(q.get("timeout") or 60), float(q.get("retry") or 60)
    return max(timeout + 1, (timeout + retry) / 2)


def _refuse_a_locking_sqlite() -> None:
    """On SQLite without the options that make writers wait (``jobs.W015``), concurrent
    enqueues would fail with "database is locked": the worker refuses to start and says
    what to paste into settings.py (``runserver`` and ``check`` show the same warning)."""
    from jobs import checks

    found = checks.check_sqlite()
    if found:
        raise CommandError(
            f"refusing to start: {found[0].msg} ({found[0].id}). {found[0].hint} "
            "(docs/app/deployment.md, SQLite)"
        )


class Command(BaseCommand):
    help = (
        "Run the django-q2 cluster (manage.py qcluster) under supervision: wait for the "
        "database, restart the cluster when it exits or stops making progress while "
        "messages wait, stop its whole process group on SIGTERM/SIGINT. --queue serves "
        "only the job queues named (one cluster taking all of their messages)."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--stall-seconds",
            type=float,
            default=None,
            help="restart the cluster after this long without a delivery while messages "
            "wait (default: halfway between Q_CLUSTER timeout and retry)",
        )
        parser.add_argument(
            "--stop-timeout",
            type=float,
            default=30.0,
            help="seconds a graceful stop may take before the group is killed (default 30)",
        )
        parser.add_argument(
            "--ping-timeout",
            type=float,
            default=PING_TIMEOUT,
            help="seconds one look at the database may take before it counts as unavailable "
            f"(a cut connection that answers nothing; default {PING_TIMEOUT:g})",
        )
        parser.add_argument(
            "--queue",
            action="append",
            dest="queues",
            default=None,
            metavar="NAME",
            help="serve this job queue (repeat for several: --queue reports --queue default); "
            "default: the 'default' queue only (docs/app/scheduling.md)",
        )
        parser.add_argument("--serve-queues", default="", help=argparse.SUPPRESS)
        parser.add_argument(
            "--max-backoff",
            type=float,
            default=5.0,
            help="longest wait between database tries and between quick restarts (default 5)",
        )

    def handle(self, *args, stall_seconds, stop_timeout, max_backoff, ping_timeout, **options):
        if options.get("serve_queues"):
            # The supervised child: a django-q2 cluster taking these queues' messages.
            serve_queues(options["serve_queues"].split(","))
            return
        _refuse_a_locking_sqlite()
        queues = []
        for name in options.get("queues") or []:
            try:
                queues.append(check_queue(name))
            except ValueError as exc:
                raise CommandError(f"--queue {name!r}: {exc}") from exc
        queues = list(dict.fromkeys(queues))
        q = getattr(settings, "Q_CLUSTER", {})
        timeout, retry = float(q.get("timeout") or 0), float(q.get("retry") or 0)
        stall = default_stall_seconds() if stall_seconds is None else stall_seconds
        if stall <= timeout:
            raise CommandError(
                f"--stall-seconds ({stall:g}) must exceed Q_CLUSTER['timeout'] ({timeout:g}): "
                "a delivery may legitimately run that long"
            )
        if stop_timeout < 0 or max_backoff <= 0 or ping_timeout <= 0:
            raise CommandError("--stop-timeout must be >= 0, --max-backoff and --ping-timeout > 0")
        # At most 2.5 s between looks during an outage, at most 5 s while the cluster is
        # idle: with the ping's own deadline, a database that stopped answering is in the
        # log within seconds (a ping costs one SELECT 1; a cluster at work, none).
        check_every = min(2.5, max(0.5, stall / 4))
        ping_every = min(5.0, max(check_every, stall / 2))
        if retry > stall:  # a message a stalled cluster holds is seen for retry - stall
            check_every = max(0.25, min(check_every, (retry - stall) / 2))
        options_ = Options(
            stall_seconds=stall,
            stop_timeout=stop_timeout,
            max_backoff=max_backoff,
            check_every=check_every,
            ping_every=ping_every,
            ping_timeout=ping_timeout,
            queues=tuple(queues) if queues != ["default"] else (),
        )
        Supervisor(options_).run()
