"""The morning digest: each reviewer hears once a day what waits for their review.

A periodic kind (``jobs.schedules``): each tick of ``PERMITS_DIGEST_CRON`` (default 07:00
on weekdays, in ``TIME_ZONE``) is one job, whoever's dispatcher asks first; the job asks
for one in-app notice per reviewer with something waiting, and the ledger's effect
identity (job, tick, name, reviewer) makes it one notice per reviewer per day, however
often a worker redelivers it. The notice holds counts and a link, never request data.
An empty ``PERMITS_DIGEST_CRON`` leaves the kind without a schedule.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models import Exists, OuterRef

import jobs
from jobs.models import Effect
from permits.models import REVIEW_PERM, PermitRequest, ReviewDecision

KIND = "permits.morning-digest"
NOTICE = "morning-digest"
REVIEWERS = "reviewers"


def waiting_for(user) -> int:
    """Requests in review that ``user`` reviews and has not decided at their revision."""
    from guardian.shortcuts import get_objects_for_user

    mine = get_objects_for_user(
        user,
        REVIEW_PERM,
        klass=PermitRequest.objects.filter(status=PermitRequest.Status.IN_REVIEW),
        accept_global_perms=False,
    )
    decided = ReviewDecision.objects.filter(
        request=OuterRef("pk"), reviewer=user, revision=OuterRef("output_revision")
    )
    return mine.annotate(decided=Exists(decided)).filter(decided=False).count()


def digest(ctx: jobs.JobContext) -> list[jobs.EffectSpec]:
    """One notice per active reviewer with requests waiting (counts only)."""
    ctx.check_owner()
    reviewers = get_user_model().objects.filter(is_active=True, groups__name=REVIEWERS)
    found = list(reviewers.order_by("pk").distinct())
    specs = []
    for i, user in enumerate(found, 1):
        n = waiting_for(user)
        ctx.progress(i, len(found), "counting")
        if not n:
            continue
        title = f"Good morning: {n} request{'s' if n != 1 else ''} wait for your review"
        specs.append(jobs.EffectSpec(NOTICE, "inapp", str(user.pk), {"title": title, "link": "/"}))
    return specs


def authorize_release(effect: Effect) -> str | None:
    """The recipient is still an active reviewer when the notice goes out."""
    still = get_user_model().objects.filter(
        pk=effect.recipient, is_active=True, groups__name=REVIEWERS
    )
    return None if still.exists() else "the recipient is no longer an active reviewer"


def register() -> None:
    cron = getattr(settings, "PERMITS_DIGEST_CRON", "0 7 * * 1-5") or None
    jobs.register_kind(
        KIND,
        digest,
        authorize_release=authorize_release,
        schedule=cron,
        schedule_tz=settings.TIME_ZONE if cron else None,
        catch_up="latest",  # after downtime, today's digest only, never a backlog of days
        max_attempts=3,
    )
