"""The outage-then-recovery burst drill (see ``jobs.contrib.drills.burst``)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from jobs.contrib.drills import burst


class Command(BaseCommand):
    help = (
        "Provider down, N jobs complete and their notices queue up, provider comes back: "
        "prints from the provider's own record the most calls in flight at once, calls per "
        "second, notices applied and duplicate effects; exits 1 if the bound was exceeded, "
        "a notice is missing or one was applied twice."
    )

    def add_arguments(self, parser):
        d = burst.BurstConfig()
        parser.add_argument("--jobs", type=int, default=d.jobs)
        parser.add_argument("--workers", type=int, default=d.workers, help="worker processes")
        parser.add_argument(
            "--max-in-flight",
            type=int,
            default=d.max_in_flight,
            help="NOTICE_PROVIDER_MAX_IN_FLIGHT for the run",
        )
        parser.add_argument("--connect-timeout", type=float, default=d.connect_timeout)
        parser.add_argument("--read-timeout", type=float, default=d.read_timeout)
        parser.add_argument("--slot-wait", type=float, default=d.slot_wait)
        parser.add_argument(
            "--provider-delay",
            type=float,
            default=d.provider_delay,
            help="seconds the stand-in takes to answer each call",
        )
        parser.add_argument(
            "--down-seconds",
            type=float,
            default=d.down_seconds,
            help="keep the provider down at least this long after the last job finished",
        )
        parser.add_argument("--backoff-cap", type=float, default=d.backoff_cap)
        parser.add_argument(
            "--rate",
            default=None,
            help="a provider:webhook rate rule for the run (e.g. 5/s), checked at the record",
        )
        parser.add_argument(
            "--circuit-failures",
            type=int,
            default=d.circuit_failures,
            help="JOBS_CIRCUIT_FAILURES for the run",
        )
        parser.add_argument("--timeout", type=float, default=d.timeout, help="give up after")
        parser.add_argument("--record", default=None, help="the stand-in's record file")
        parser.add_argument("--json", action="store_true", help="machine-readable report")
        # Internal: the drill starts its worker processes through this command.
        parser.add_argument("--worker", type=int, default=None, help="(internal) worker index")
        parser.add_argument("--of", type=int, default=None, help="(internal) worker count")
        parser.add_argument("run", nargs="?", help="(internal) run id for --worker")

    def handle(self, *args, **o):
        if o["worker"] is not None:
            if not o["run"] or not o["of"]:
                raise CommandError("--worker needs --of and a run id")
            burst.work(o["run"], o["worker"], o["of"])
            return
        if o["jobs"] < 1 or o["workers"] < 1 or o["max_in_flight"] < 1:
            raise CommandError("--jobs, --workers and --max-in-flight must be at least 1")
        config = burst.BurstConfig(
            jobs=o["jobs"],
            workers=o["workers"],
            max_in_flight=o["max_in_flight"],
            connect_timeout=o["connect_timeout"],
            read_timeout=o["read_timeout"],
            slot_wait=o["slot_wait"],
            provider_delay=o["provider_delay"],
            down_seconds=o["down_seconds"],
            backoff_cap=o["backoff_cap"],
            timeout=o["timeout"],
            record=o["record"],
            rate=o["rate"],
            circuit_failures=o["circuit_failures"],
        )
        if config.connect_timeout + config.read_timeout + config.slot_wait >= config.effect_lease:
            raise CommandError("connect + read timeouts + slot wait must stay below the lease")
        say = None if o["json"] else self.stdout.write
        report = burst.run(config, out=say)
        if o["json"]:
            self.stdout.write(json.dumps(report.as_dict(), indent=2))
        else:
            self.print_report(report)
        if not report.passed:
            raise SystemExit(1)

    def print_report(self, r: burst.BurstReport) -> None:
        w = self.stdout.write
        c = r.config
        w("")
        w(
            f"provider settings: max in flight {c['max_in_flight']}, connect timeout "
            f"{c['connect_timeout']:g} s, read timeout {c['read_timeout']:g} s, slot wait "
            f"{c['slot_wait']:g} s, answer latency {c['provider_delay']:g} s; "
            f"{c['workers']} worker processes; backoff floor {c['backoff_floor']:g} s, "
            f"base {c['backoff_base']:g} s, cap {c['backoff_cap']:g} s (full jitter)"
        )
        w("calls per second after the provider came back (from the provider's record):")
        for second, n in r.calls_per_second:
            w(f"  {second:>4} s  {n:>4}  {'#' * min(n, 100)}")
        w("")
        w(f"most calls in flight at once   {r.max_in_flight}  (bound {c['max_in_flight']})")
        w(f"peak calls per second          {r.peak_calls_per_second}")
        w(f"notices applied                {r.notices_applied} of {r.notices_expected}")
        w(f"duplicate effects              {len(r.applied_twice)}")
        w(f"resends under the same key     {r.resends_same_key}")
        w(f"sends refused while down       {r.refused_while_down}  (ledger)")
        w(f"notices held at open circuit   {r.held_by_circuit}  (no call, no attempt)")
        if c.get("rate"):
            w(f"most calls in one rate window  {r.max_in_rate_window}  (rule {c['rate']}, +1 edge)")
        if r.drain_calls_per_second is not None:
            w(f"drain rate                     {r.drain_calls_per_second:g} notices/s")
        w(f"ledger rows applied            {r.ledger_applied} of {r.notices_expected}")
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(r.provider_requests.items()))
        w(f"provider answers               {answers or 'none'}")
        if r.recovery_seconds is not None:
            w(
                f"outage {r.outage_seconds:.1f} s; all notices final "
                f"{r.recovery_seconds:.1f} s after the provider came back"
            )
        if r.passed:
            w(self.style.SUCCESS("PASS: bound held, every notice applied exactly once"))
        else:
            for problem in r.problems:
                w(self.style.ERROR(f"FAIL: {problem}"))
