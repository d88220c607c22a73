"""Install the dispatcher's django-q2 schedule after migrate (idempotent)."""

from __future__ import annotations


def install_dispatch_schedule(sender=None, **kwargs) -> None:
    from django_q.models import Schedule

    Schedule.objects.update_or_create(
        name="jobs.dispatch",
        defaults={
            "func": "jobs.tasks.run_dispatcher",
            "schedule_type": Schedule.MINUTES,
            "minutes": 1,
            "repeats": -1,
        },
    )
