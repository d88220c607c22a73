"""Remove old delivery history, finished ledger rows and orphan artifact files (jobs.retention)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from jobs import archive
from jobs.retention import prune, prune_manifests, prune_orphans


class Command(BaseCommand):
    help = (
        "Delete orphan artifact files (named by no row, older than JOBS_ORPHAN_GRACE_SECONDS) "
        "and, with --older-than, attempts and final effects of jobs finished more than DAYS ago; "
        "with --archive, archive settled jobs finished more than JOBS_ARCHIVE_AFTER_DAYS "
        "(or --archive-after DAYS) ago: their rows go, an identity record stays."
    )

    def add_arguments(self, parser):
        parser.add_argument("--older-than", type=float, metavar="DAYS")
        parser.add_argument("--archive", action="store_true")
        parser.add_argument("--archive-after", type=float, metavar="DAYS")
        parser.add_argument("--dry-run", action="store_true")

    def handle(self, *args, older_than: float | None, dry_run: bool, **options):
        verb = "would delete" if dry_run else "deleted"
        if options["archive"] or options["archive_after"] is not None:
            self._archive(options["archive_after"], dry_run=dry_run)
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

    def _archive(self, days: float | None, *, dry_run: bool) -> None:
        days = archive.archive_after_days() if days is None else days
        if days is None:
            raise CommandError("--archive needs JOBS_ARCHIVE_AFTER_DAYS or --archive-after DAYS")
        try:
            if dry_run:
                count = archive.count_archivable(older_than_days=days)
                self.stdout.write(
                    f"would archive {count} jobs finished more than {days:g} days ago"
                )
                return
            done = archive.archive(older_than_days=days)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"archived {done.jobs} jobs ({done.effects} effect identities) in "
            f"{done.batches} batches, {done.seconds:.2f} s"
        )
