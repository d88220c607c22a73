"""Find what a failover lost, ask for it again, record what the outside world has."""

from __future__ import annotations

import json
import time

from django.core.management.base import BaseCommand

from jobs.reconcile import Report, read_provider_keys, reconcile


class Command(BaseCommand):
    help = (
        "After a failover: list jobs whose artifact objects are stored but whose rows the "
        "database lacks, and keys providers accepted that the ledger lacks (their listings, "
        "or --provider-keys); ask again for lost jobs whose subject exists, under their own "
        "uid, so no notice goes out twice. Run it before jobs_prune."
    )

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", dest="as_json", help="one document")
        parser.add_argument(
            "--provider-keys",
            metavar="FILE",
            help="the idempotency keys a provider accepted, one a line (optionally followed "
            "by the effect id it recorded): list those the ledger lacks",
        )
        parser.add_argument(
            "--since-hours",
            type=float,
            default=24.0,
            help="ask providers with a listing for what they applied this far back (24)",
        )
        parser.add_argument(
            "--no-providers", action="store_true", help="do not ask providers for listings"
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="report only: ask for nothing, mark nothing"
        )

    def handle(self, *args, as_json: bool = False, provider_keys: str | None = None, **options):
        accepted = None
        if provider_keys:
            with open(provider_keys, encoding="utf-8") as fh:
                accepted = read_provider_keys(fh)
        report = reconcile(
            accepted=accepted,
            since=time.time() - options["since_hours"] * 3600,
            ask_providers=not options["no_providers"],
            dry_run=options["dry_run"],
        )
        if as_json:
            self.stdout.write(json.dumps(report.as_dict(), indent=2))
            return
        listed = any(a.startswith("listed") for a in report.providers.values())
        self._text(report, listed=bool(provider_keys) or listed)

    def _text(self, report: Report, *, listed: bool) -> None:
        for name, answer in report.providers.items():
            self.stdout.write(f"provider {name}: {answer}")
        for u in report.unknown:
            self.stdout.write(
                f"accepted key {u.idempotency_key} effect={u.effect_id or '-'}: not in the ledger"
            )
        verb = "would be" if report.dry_run else "were"
        for job in report.lost:
            made = "unknown" if job.made_at is None else job.made_at.isoformat()
            what, pk = report.outcomes.get(job.job, ("", None))
            subject = (
                f" subject={job.manifest.subject_type}:{job.manifest.subject_id}"
                if job.manifest
                else ""
            )
            self.stdout.write(
                f"lost job {job.job} kind={job.kind_folder} revision={job.revision} "
                f"made={made} objects={len(job.objects)}{subject}: {what}"
                + (f" (job {pk})" if pk else "")
            )
        self.stdout.write(
            f"asked again: {report.asked_again}; jobs that {verb} marked to look their sends "
            f"up first: {report.marked}"
        )
        self.stdout.write(f"lost jobs: {len(report.lost)}")
        if listed:
            self.stdout.write(f"accepted keys not in the ledger: {len(report.unknown)}")
