"""Bookkeeping rows: a periodic kind's newest tick, the database timeline last reconciled
after (each moved forward by compare-and-swap; the identities they guard, a tick's job, a
reconcile's re-requests, are what make the outcome once, so a round that read a row stale
only asks again), and each tenant's place in its queue's fair share. Part of ``jobs.models``.
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


class TenantShare(models.Model):
    """A tenant's place in its queue's fair share (``jobs.fairness``): start-time fair queueing.

    ``start`` is the virtual start tag of the tenant's last claim and ``finish`` that tag
    plus ``1 / weight``; the queue's virtual time is the largest ``start`` of its rows.
    Written by the next-job claim that starts one of the tenant's jobs, in its transaction."""

    queue = models.CharField(max_length=64)
    tenant_key = models.CharField(max_length=64, blank=True, default="")
    start = models.FloatField(default=0.0)
    finish = models.FloatField(default=0.0)
    weight = models.FloatField(default=1.0, help_text="the weight its last claim was charged at")
    claims = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["queue", "tenant_key"]
        constraints = [
            models.UniqueConstraint(fields=["queue", "tenant_key"], name="jobs_share_queue_tenant"),
        ]
        indexes = [models.Index(fields=["queue", "start"], name="jobs_share_vtime_idx")]

    def __str__(self) -> str:
        return f"{self.queue}/{self.tenant_key or '-'}: finish {self.finish:g}"
