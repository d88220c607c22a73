"""Retention: old delivery history and finished ledger rows, never inside the redelivery window.

Pruning an effect's identity forgets that the outcome happened; if anything
could still ask for it again, the ledger could no longer say "already done".
So only effects in a final state, of finished jobs, older than a window far
longer than any redelivery (django-q2 ``retry``, leases, the dispatcher's
re-drives) are removed. Job rows are kept: they are what makes a second
request for the same output return the same job.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from jobs import conf
from jobs.models import Attempt, Effect, Job


def minimum_days() -> float:
    """The shortest window allowed: a week, or 100x the longest redelivery delay."""
    q = conf.q_cluster()
    longest = max(
        float(q.get("retry", 60)),
        conf.lease_seconds(),
        float(conf.get("JOBS_EFFECT_LEASE_SECONDS")),
        float(conf.get("JOBS_BACKOFF_CAP_SECONDS")),
    )
    return max(float(conf.get("JOBS_PRUNE_MIN_DAYS")), 100 * longest / 86400)


def prune(*, older_than_days: float, dry_run: bool = False) -> dict[str, int]:
    """Delete attempts and final effects of terminal jobs finished before the window."""
    if older_than_days < minimum_days():
        raise ValueError(
            f"--older-than {older_than_days:g} is inside the redelivery safety window "
            f"({minimum_days():g} days)"
        )
    cutoff = timezone.now() - timedelta(days=older_than_days)
    finished = Job.objects.filter(state__in=Job.TERMINAL, finished_at__lt=cutoff)
    attempts = Attempt.objects.filter(job__in=finished, started_at__lt=cutoff)
    effects = Effect.objects.filter(
        job__in=finished,
        state__in=[Effect.State.APPLIED, Effect.State.WITHHELD, Effect.State.FAILED],
        updated_at__lt=cutoff,
        notice__isnull=True,
    )
    counts = {"attempts": attempts.count(), "effects": effects.count()}
    if not dry_run:
        with transaction.atomic():
            attempts.delete()
            effects.delete()
    return counts
