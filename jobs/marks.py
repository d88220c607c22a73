"""The maintenance round's bookkeeping between rounds: a periodic kind's newest tick and the
database timeline last reconciled after. Each row is moved forward by compare-and-swap;
the identities they guard (a tick's job, a reconcile's re-requests) are what make the
outcome once, so a round that read a row stale only asks again. Part of ``jobs.models``.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class ScheduleState(models.Model):
    """The newest tick a periodic kind's schedule has requested (``jobs.schedules``).

    Bookkeeping, moved forward by compare-and-swap: the tick's job identity is what makes
    each tick one job, so a dispatcher that read this row stale only asks again."""

    kind = models.CharField(max_length=64, unique=True)
    last_tick = models.DateTimeField()
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["kind"]

    def __str__(self) -> str:
        return f"schedule of {self.kind}: last tick {self.last_tick:%Y-%m-%dT%H:%M:%SZ}"


class ReconcileMark(models.Model):
    """The last database timeline ``jobs.reconcile`` reconciled after (issue 47).

    A promotion moves PostgreSQL to a new timeline; the maintenance loop compares the
    server's with this row and reconciles once per change, the CAS winner of many hosts."""

    name = models.CharField(max_length=32, unique=True)
    timeline = models.BigIntegerField(help_text="the timeline last reconciled after")
    claimed_by = models.CharField(max_length=200, blank=True, default="")
    claimed_until = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name}: timeline {self.timeline}"
