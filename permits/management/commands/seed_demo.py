"""Seed the demo (idempotent): an operator, reviewer47 and one demo job."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from jobs.services import request_job

DEMO_LOGINS = {"operator": "operator-demo", "reviewer47": "reviewer-demo"}


class Command(BaseCommand):
    help = "Create the demo accounts and a demo job; running it twice changes nothing."

    @transaction.atomic
    def handle(self, *args, **options):
        User = get_user_model()
        operator, created = User.objects.get_or_create(
            username="operator", defaults={"is_staff": True, "is_superuser": True}
        )
        if created:
            operator.set_password(DEMO_LOGINS["operator"])
            operator.save()
        reviewer, created = User.objects.get_or_create(
            username="reviewer47", defaults={"is_staff": True}
        )
        if created:
            reviewer.set_password(DEMO_LOGINS["reviewer47"])
            reviewer.save()
        job, _ = request_job(
            "demo.summary",
            subject_type="auth.user",
            subject_id=reviewer.pk,
            output_revision=1,
            tenant_key="demo",
            params={"notify_user_id": reviewer.pk},
        )
        self.stdout.write(
            f"demo job {job.pk} ({job.state}); logins: "
            + ", ".join(f"{u} / {p}" for u, p in DEMO_LOGINS.items())
        )
