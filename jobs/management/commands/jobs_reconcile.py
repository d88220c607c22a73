"""List the jobs a failover lost, as the artifact storage shows them (jobs.reconcile)."""

from __future__ import annotations

import json
from dataclasses import asdict

from django.core.management.base import BaseCommand

from jobs.reconcile import lost_jobs, read_provider_keys, unknown_keys


class Command(BaseCommand):
    help = (
        "List jobs whose artifact objects are stored but whose rows the database lacks "
        "(what a failover to an asynchronous standby lost) and, with --provider-keys, the keys "
        "a provider accepted that the ledger lacks. Run it before jobs_prune."
    )

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", dest="as_json", help="one document")
        parser.add_argument(
            "--provider-keys",
            metavar="FILE",
            help="the idempotency keys a provider accepted, one a line (optionally followed "
            "by the effect id it recorded): list those the ledger lacks",
        )

    def handle(self, *args, as_json: bool = False, provider_keys: str | None = None, **options):
        lost = lost_jobs()
        unknown = []
        if provider_keys:
            with open(provider_keys, encoding="utf-8") as fh:
                unknown = unknown_keys(read_provider_keys(fh))
        if as_json:
            document = {"lost_jobs": [job.as_dict() for job in lost]}
            if provider_keys:
                document["unknown_keys"] = [asdict(u) for u in unknown]
            self.stdout.write(json.dumps(document, indent=2))
            return
        for u in unknown:
            self.stdout.write(
                f"accepted key {u.idempotency_key} effect={u.effect_id or '-'}: not in the ledger"
            )
        for job in lost:
            made = "unknown" if job.made_at is None else job.made_at.isoformat()
            self.stdout.write(
                f"lost job {job.job} kind={job.kind_folder} revision={job.revision} "
                f"made={made} objects={len(job.objects)}"
            )
        self.stdout.write(f"lost jobs: {len(lost)}")
        if provider_keys:
            self.stdout.write(f"accepted keys not in the ledger: {len(unknown)}")
