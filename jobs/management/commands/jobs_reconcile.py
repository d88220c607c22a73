"""List the jobs a failover lost, as the artifact storage shows them (jobs.reconcile)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand

from jobs.reconcile import lost_jobs


class Command(BaseCommand):
    help = (
        "List jobs whose artifact objects are stored but whose rows the database lacks "
        "(what a failover to an asynchronous standby lost). Run it before jobs_prune."
    )

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", dest="as_json", help="one document")

    def handle(self, *args, as_json: bool = False, **options):
        lost = lost_jobs()
        if as_json:
            document = {"lost_jobs": [job.as_dict() for job in lost]}
            self.stdout.write(json.dumps(document, indent=2))
            return
        for job in lost:
            made = "unknown" if job.made_at is None else job.made_at.isoformat()
            self.stdout.write(
                f"lost job {job.job} kind={job.kind_folder} revision={job.revision} "
                f"made={made} objects={len(job.objects)}"
            )
        self.stdout.write(f"lost jobs: {len(lost)}")
