"""Seed the demo (idempotent): offices, reviewer47, an operator, an office admin (each
person in their offices), a dozen requests, job 84; reviewer52's decision on request 11
(its letter's chain: ``permits.letters``, the letter on the ``heavy`` queue) and, where the
morning digest has a schedule (the demo's), its latest tick."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand
from django.core.management.color import no_style
from django.db import connection, transaction

from jobs.models import Job
from jobs.queue import enqueue_job
from permits import digest, reports
from permits.models import PermitRequest, ReviewDecision, Tenant
from permits.services import assign_reviewer, decide
from permits.signals import OFFICE_ADMINS, create_groups

DEMO_LOGINS = {
    "reviewer47": "reviewer-demo",
    "reviewer52": "reviewer-demo",
    "operator": "operator-demo",
    "officeadmin": "officeadmin-demo",
}
WT = PermitRequest.WorkType
# id, office, work type, address, valuation, assigned to reviewer47?
REQUESTS = [
    (1, "springfield", WT.NEW_BUILDING, "12 Evergreen Terrace", "420000", True),
    (2, "springfield", WT.ADDITION, "742 Elm Street", "85000", True),
    (3, "springfield", WT.ALTERATION, "19 Maple Court", "32000", True),
    (4, "springfield", WT.ELECTRICAL, "3 Harbor Road", "7800", True),
    (5, "springfield", WT.PLUMBING, "88 Quarry Lane", "5400", True),
    (6, "springfield", WT.DECK_FENCE, "51 Orchard Way", "9100", False),
    (7, "springfield", WT.NEW_BUILDING, "1 Civic Plaza", "1250000", True),
    (8, "springfield", WT.DEMOLITION, "640 Mill Street", "26000", True),
    (9, "shelbyville", WT.MECHANICAL, "77 Lake Drive", "14500", False),
    (10, "shelbyville", WT.ADDITION, "205 Pine Avenue", "99000", False),
    (11, "shelbyville", WT.ALTERATION, "9 Station Square", "41000", False),
    (12, "shelbyville", WT.NEW_BUILDING, "300 Ridge Road", "610000", False),
]
DEMO_JOB_ID, DEMO_PERMIT_ID, DEMO_REVISION = 84, 7, 29
# A decided request: reviewer52 approves Shelbyville's request 11, which asks for the
# applicant's letter after the report (a chain of two jobs, the letter on the heavy queue).
DECIDED_PERMIT_ID = 11
DECISION_COMMENT = "The plans meet the code; inspections as listed in the report."
EPOCH = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)


class Command(BaseCommand):
    help = (
        "Create the demo offices, accounts (reviewers, an operator, an office admin), "
        "requests and report job 84 (revision 29)."
    )

    @transaction.atomic
    def handle(self, *args, **options):
        offices = {
            "springfield": Tenant.objects.get_or_create(
                key="springfield", defaults={"name": "Springfield Permit Office"}
            )[0],
            "shelbyville": Tenant.objects.get_or_create(
                key="shelbyville", defaults={"name": "Shelbyville Building Department"}
            )[0],
        }
        reviewer47 = self._user("reviewer47", pk=47, group="reviewers")
        reviewer52 = self._user("reviewer52", pk=52, group="reviewers")
        self._reset_sequences()  # else the operator's new id may be 47 or 52 itself
        self._user("operator", pk=None, group="operators")
        # Assigning reviewers is the office admins' duty (not the operators'): the group
        # and its permissions exist after migrate; made sure of here as well.
        create_groups()
        officeadmin = self._user("officeadmin", pk=None, group=OFFICE_ADMINS)
        # Each person's office(s): the office admin and reviewer47 work for Springfield,
        # reviewer52 for both (as the requests assigned below say).
        for user, keys in (
            (reviewer47, ["springfield"]),
            (reviewer52, ["springfield", "shelbyville"]),
            (officeadmin, ["springfield"]),
        ):
            for key in keys:
                offices[key].members.add(user)

        assignments = []
        for pk, office, work_type, address, valuation, mine in REQUESTS:
            permit, _ = PermitRequest.objects.get_or_create(
                pk=pk,
                defaults={
                    "tenant": offices[office],
                    "reference": f"{office[:3].upper()}-2026-{pk:04d}",
                    "site_address": f"{address}, {offices[office].name.split()[0]}",
                    "parcel": f"{office[:2].upper()}-{1000 + pk * 37}-{pk:02d}",
                    "work_type": work_type,
                    "description": f"{WT(work_type).label} at {address}: plans and specifications "
                    "as submitted with the application.",
                    "valuation": Decimal(valuation),
                    "status": PermitRequest.Status.IN_REVIEW,
                    "output_revision": DEMO_REVISION if pk == DEMO_PERMIT_ID else 1,
                    "applicant_name": f"Demo Applicant {pk}",
                    "applicant_phone": f"+1 555 01{pk:02d}",
                    "applicant_email": f"applicant{pk}@example.org",
                    "applicant_id_number": f"ID-{pk:03d}-{9000 + pk}",
                    "submitted_at": EPOCH + timedelta(hours=pk),
                },
            )
            assignments.append((permit, reviewer47 if mine else reviewer52))

        permit = PermitRequest.objects.get(pk=DEMO_PERMIT_ID)
        job, created = Job.objects.get_or_create(
            pk=DEMO_JOB_ID,
            defaults={
                "kind": reports.KIND,
                "subject_type": reports.SUBJECT_TYPE,
                "subject_id": str(permit.pk),
                "output_revision": DEMO_REVISION,
                "tenant_key": permit.tenant.key,
                "next_attempt_at": EPOCH,
                "created_at": EPOCH,
            },
        )
        if created:
            enqueue_job(job)
        self._reset_sequences()
        # Assigned after job 84 exists, so request 7's report is that job. Each
        # assignment asks for the request's report (``services.ensure_report``): the
        # reviewers find every report requested, none to press a button for.
        for request, reviewer in assignments:
            assign_reviewer(request, reviewer)
        self._reset_sequences()
        self._decide(reviewer52)
        self._digest_tick()
        self.stdout.write(
            f"report job {job.pk} for {permit.reference} "
            f"revision {job.output_revision}: {job.state}"
        )
        self.stdout.write("logins: " + ", ".join(f"{u} / {p}" for u, p in DEMO_LOGINS.items()))

    def _decide(self, reviewer) -> None:
        """reviewer52's approval of request 11 (once: a second seed finds it)."""
        permit = PermitRequest.objects.get(pk=DECIDED_PERMIT_ID)
        if ReviewDecision.objects.filter(request=permit).exists():
            return
        decide(
            permit,
            reviewer,
            decision=ReviewDecision.Decision.APPROVE,
            comment=DECISION_COMMENT,
            revision=permit.output_revision,
        )

    def _digest_tick(self) -> None:
        """The morning digest's latest tick, as a dispatcher that found it due would ask
        for it, so the demo shows a digest job at once (only where the kind is periodic:
        ``PERMITS_DIGEST_CRON``; the tests' settings give it no schedule)."""
        from jobs import schedules
        from jobs.api import request
        from jobs.models import ScheduleState

        schedule = schedules.collect()[0].get(digest.KIND)
        if schedule is None:
            return
        latest = schedule.latest_at(schedules.server_now())
        if latest is None:
            return
        request(digest.KIND, (schedules.SUBJECT_TYPE, schedules.tick_id(latest)))
        # The dispatcher then starts after this tick (it never asks for it twice).
        state, _ = ScheduleState.objects.get_or_create(
            kind=digest.KIND, defaults={"last_tick": latest}
        )
        ScheduleState.objects.filter(pk=state.pk, last_tick__lt=latest).update(last_tick=latest)

    def _user(self, username: str, *, pk: int | None, group: str):
        """The demo user by name; created with the id the demo names (47) when it is free."""
        User = get_user_model()
        user = User.objects.filter(username=username).first()
        if user is None:
            free = pk is not None and not User.objects.filter(pk=pk).exists()
            user = User(pk=pk if free else None, username=username, is_staff=True)
            user.set_password(DEMO_LOGINS[username])
            user.save()
        user.groups.add(Group.objects.get_or_create(name=group)[0])
        return user

    def _reset_sequences(self) -> None:
        """Explicit ids do not move PostgreSQL sequences; move them past the seeded rows."""
        sql = connection.ops.sequence_reset_sql(
            no_style(), [get_user_model(), PermitRequest, Tenant, Job]
        )
        with connection.cursor() as cursor:
            for statement in sql:
                cursor.execute(statement)
