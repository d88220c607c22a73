"""Remove old delivery history, finished ledger rows and orphan artifact files (jobs.retention)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from jobs.retention import prune, prune_manifests, prune_orphans


class Command(BaseCommand):
    help = (
        "Delete orphan artifact files (named by no row, older than JOBS_ORPHAN_GRACE_SECONDS) "
        "and, with --older-than, attempts and final effects of jobs finished more than DAYS ago."
    )

    def add_arguments(self, parser):
        parser.add_argument("--older-than", type=float, metavar="DAYS")
        parser.add_argument("--dry-run", action="store_true")

    def handle(self, *args, older_than: float | None, dry_run: bool, **options):
        verb = "would delete" if dry_run else "deleted"
        if older_than is not None:
            try:
                counts = prune(older_than_days=older_than, dry_run=dry_run)
            except ValueError as exc:
                raise CommandError(str(exc)) from None
            self.stdout.write(f"{verb} {counts['attempts']} attempts, {counts['effects']} effects")
        orphans = prune_orphans(dry_run=dry_run)
        self.stdout.write(f"{verb} {orphans} orphan artifact files")
        manifests = prune_manifests(dry_run=dry_run)
        self.stdout.write(f"{verb} {manifests} identity manifests of finished jobs")
