"""Ask for the report of a permit request; prints the job id (the same id every time)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from permits.models import PermitRequest
from permits.services import report_request


class Command(BaseCommand):
    help = "Request the report job for PERMIT_ID (at its current or the given revision)."

    def add_arguments(self, parser):
        parser.add_argument("permit_id", type=int)
        parser.add_argument("--revision", type=int, default=None)

    def handle(self, *args, permit_id: int, revision: int | None, **options):
        permit = PermitRequest.objects.select_related("tenant").filter(pk=permit_id).first()
        if permit is None:
            raise CommandError(f"permit request {permit_id} does not exist")
        if revision is not None and not 1 <= revision <= permit.output_revision:
            raise CommandError(
                f"revision {revision} is not between 1 and the current revision "
                f"{permit.output_revision}"
            )
        job, _ = report_request(permit, revision=revision)
        self.stdout.write(str(job.pk))
