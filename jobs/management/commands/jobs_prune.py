"""Remove old delivery history and finished ledger rows (see jobs.retention)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from jobs.retention import prune


class Command(BaseCommand):
    help = "Delete attempts and final effects of jobs finished more than DAYS ago."

    def add_arguments(self, parser):
        parser.add_argument("--older-than", type=float, required=True, metavar="DAYS")
        parser.add_argument("--dry-run", action="store_true")

    def handle(self, *args, older_than: float, dry_run: bool, **options):
        try:
            counts = prune(older_than_days=older_than, dry_run=dry_run)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        verb = "would delete" if dry_run else "deleted"
        self.stdout.write(f"{verb} {counts['attempts']} attempts, {counts['effects']} effects")
