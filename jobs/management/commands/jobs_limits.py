"""Show and change the flow-control rules live: ``show | set | pause | resume | delete``."""

from __future__ import annotations

import getpass

from django.core.management.base import BaseCommand, CommandError

from jobs import flow
from jobs.ops import flowview


class Command(BaseCommand):
    help = (
        f"Flow control per scope ({flow.SCOPE_FORMS}): show, set --rate N/s|N/m "
        f"--concurrency N --weight N (rate 1..{flow.RATE_MAX:,} per period of at most one day, "
        f"concurrency 1..{flow.CONCURRENCY_MAX:,}), pause, resume, delete. Takes effect in "
        "every worker within 2 seconds, no restart."
    )

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("show", help="every rule with in-flight, starts last minute, waiting")
        s = sub.add_parser("set", help="create or change a scope's rule")
        s.add_argument("scope")
        s.add_argument("--rate", help="N/s, N/m, N/h, N/<seconds>s, or off")
        s.add_argument("--concurrency", help="most at once; 'default' for the settings' value")
        s.add_argument(
            "--weight",
            help="tenant:<key> (or tenant:*, the default): its share of the claims; 'default'",
        )
        for name in ("pause", "resume", "delete"):
            p = sub.add_parser(name, help=f"{name} a scope")
            p.add_argument("scope")
        for p in sub.choices.values():
            p.add_argument("--actor", default="", help="who acts (default: the shell user)")
            p.add_argument("--note", default="")

    def handle(self, *args, action, **options):
        actor = options.get("actor") or f"cli:{_user()}"
        try:
            if action == "show":
                return self.show()
            scope = flow.check_scope(options["scope"])
            if action == "set":
                changes = {}
                if options["rate"] is not None:
                    rate, period = flow.parse_rate(options["rate"])
                    changes.update(rate=rate, period_seconds=period)
                if options["concurrency"] is not None:
                    text = options["concurrency"].strip().lower()
                    changes["concurrency"] = (
                        None if text in ("default", "none") else flow.check_concurrency(text)
                    )
                if options["weight"] is not None:
                    text = options["weight"].strip().lower()
                    changes["weight"] = None if text in ("default", "none") else text
                if not changes:
                    raise CommandError("set needs --rate, --concurrency and/or --weight")
                rule = flow.set_rule(scope, actor=actor, note=options["note"], **changes)
            elif action == "pause":
                rule = flow.pause(scope, actor=actor)
            elif action == "resume":
                rule = flow.resume(scope, actor=actor)
            else:
                gone = flow.delete_rule(scope, actor=actor)  # what exists, by its exact name
                self.stdout.write(f"{scope}: {'deleted' if gone else 'no rule'}")
                return
        except (flow.FlowError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{scope}: {rule.describe()}")

    def show(self):
        w = self.stdout.write
        w(
            f"{'scope':<34}{'paused':<8}{'rate':<10}{'concurrency':<14}{'weight':<11}"
            f"{'in flight':>10}{'starts/min':>11}{'waiting':>9}  circuit"
        )
        for v in flowview.scope_views():
            bound = "-" if v.concurrency is None else str(v.concurrency)
            if v.concurrency_source == "settings":
                bound += " (default)"
            w(
                f"{v.scope:<34}{'yes' if v.paused else 'no':<8}{v.rate or '-':<10}{bound:<14}"
                f"{v.weight or '-':<11}{v.in_flight:>10}{v.started_last_minute:>11}"
                f"{v.waiting:>9}  {v.circuit or '-'}"
            )
        for scope, text in flow.defaults().items():
            w(f"default {scope}: {text} (settings)")


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment
        return "unknown"
