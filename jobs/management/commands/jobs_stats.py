"""Print the engine's figures: deliveries and effects counted apart."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand

from jobs.stats import collect


class Command(BaseCommand):
    help = "Jobs by state, deliveries, duplicate deliveries, retries by class, effects by state."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="machine-readable output")

    def handle(self, *args, **options):
        stats = collect(artifacts=True)
        if options["json"]:
            self.stdout.write(json.dumps(stats, indent=2, sort_keys=True))
            return
        w = self.stdout.write
        w(f"jobs                  {stats['jobs']['total']}")
        for state, n in sorted(stats["jobs"]["by_state"].items()):
            w(f"  {state:<20}{n}")
        w(f"deliveries            {stats['deliveries']}")
        w(f"duplicate deliveries  {stats['duplicate_deliveries']}")
        w(f"lease losses          {stats['lease_losses']}")
        w(f"crashes               {stats['crashes']}")
        w(f"failed deliveries     {stats['failed_deliveries']}")
        for task, n in sorted(stats["failed_deliveries_by_task"].items()):
            w(f"  {task:<20}{n}")
        w("retries by class")
        for cls, n in sorted(stats["retries_by_class"].items()):
            w(f"  {cls:<20}{n}")
        w(f"effects               {stats['effects']['total']}")
        for state, n in sorted(stats["effects"]["by_state"].items()):
            w(f"  {state:<20}{n}")
        w(f"duplicate effects     {stats['duplicate_effects']}")
        art = stats["artifacts"]
        states = " ".join(f"{k}={v}" for k, v in sorted(art["by_state"].items()))
        w(f"artifacts             {states or '0'}")
        w(f"orphan artifact files {art['orphan_files']}")
        if stats["providers"]:
            w("per provider          effects  sends  resends  lookups  duplicate effects  states")
        for name, p in sorted(stats["providers"].items()):
            states = " ".join(f"{k}={v}" for k, v in sorted(p["by_state"].items()))
            w(
                f"  {name:<20}{p['effects']:>7}{p['sends']:>7}{p['resends']:>9}"
                f"{p['lookups']:>9}{p['duplicate_effects']:>19}  {states}"
            )
