"""Redrive a group of dead jobs or failed / needs_review effects (jobs.ops.redrive)."""

from __future__ import annotations

import json

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from jobs.ops import redrive


class Command(BaseCommand):
    help = (
        "Without a group: list the groups (kind, provider, error class, state, count). With "
        "one: redrive it (at most JOBS_REDRIVE_MAX rows) as --user, or --dry-run for the counts."
    )

    def add_arguments(self, parser):
        parser.add_argument("--target", choices=[redrive.JOB, redrive.EFFECT], default="effect")
        parser.add_argument("--kind", default="")
        parser.add_argument("--provider", default="")
        parser.add_argument("--error-class", default="", help="'' for rows without one")
        parser.add_argument("--state", default="", help="dead (jobs); failed or needs_review")
        parser.add_argument(
            "--dry-run", action="store_true", help="count (lookups too), write nothing"
        )
        parser.add_argument("--user", default="", help="the operator's username (the audit record)")
        parser.add_argument("--json", action="store_true", help="machine-readable output")

    def handle(self, *args, **options):
        if not options["kind"]:
            return self._list(options["json"])
        try:
            group = redrive.Filter(
                options["target"],
                options["kind"],
                options["state"] or ("dead" if options["target"] == redrive.JOB else ""),
                options["error_class"],
                options["provider"],
            )
        except redrive.RedriveError as exc:
            raise CommandError(str(exc)) from None
        user = self._operator(options["user"], dry_run=options["dry_run"])
        result = redrive.redrive(
            group,
            operator=user.get_username() if user else "shell",
            user_id=user.pk if user else None,
            dry_run=options["dry_run"],
        )
        if options["json"]:
            self.stdout.write(json.dumps({"dry_run": result.dry_run, **result.counts()}))
            return
        prefix = "dry run: " if result.dry_run else ""
        self.stdout.write(f"{prefix}{group.words()}")
        self.stdout.write(f"{prefix}{result.words()}")
        if result.audit_id:
            self.stdout.write(f"audit record: admin log entry {result.audit_id}")

    def _operator(self, username: str, *, dry_run: bool):
        """A real redrive names an operator who may do it; a dry run needs nobody."""
        if not username:
            if dry_run:
                return None
            raise CommandError("--user USERNAME: the operator the audit record names")
        user = get_user_model().objects.filter(username=username, is_active=True).first()
        if user is None:
            raise CommandError(f"no active user {username!r}")
        if not dry_run and not all(
            user.has_perm(p) for p in ("jobs.change_job", "jobs.change_effect")
        ):
            raise CommandError(f"{username!r} may not operate jobs and effects")
        return user

    def _list(self, as_json: bool) -> None:
        found = redrive.groups()
        if as_json:
            rows = [{**g.filter.__dict__, "count": g.count} for g in found]
            self.stdout.write(json.dumps(rows))
            return
        if not found:
            self.stdout.write("nothing to redrive: no dead jobs, no failed or needs_review effects")
        for g in found:
            self.stdout.write(f"{g.count:>7}  {g.filter.words()}")
