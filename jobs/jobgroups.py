"""A group of child jobs and the join requested when the last of them ended (docs/app/
chains.md). Part of ``jobs.models``, kept apart so each module stays short.
"""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q
from django.utils import timezone


class JobGroup(models.Model):
    """N child jobs and the one join job requested when the last of them ended.

    Born with the parent's publish, with the join's request resolved then (kind, params,
    scheduling, the join kind's rule for a child that did not succeed). Each child's end
    bumps ``ended`` by a compare-and-swap on ``version`` in that end's own transaction
    (``jobs.engine.groups``); the swap that makes ``ended == size`` requests the join.
    """

    class Rule(models.TextChoices):
        FAIL = "fail", "fail the join"  # the join is born failed: it never runs
        SKIP = "skip", "skip the join"  # the join is born cancelled: it never runs
        RUN = "run", "run the join"  # the join runs and reads each child's outcome

    parent = models.ForeignKey(
        "jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="groups"
    )
    name = models.CharField(max_length=40)
    size = models.PositiveIntegerField()
    ended = models.PositiveIntegerField(default=0)
    not_succeeded = models.PositiveIntegerField(default=0)
    version = models.PositiveBigIntegerField(default=0)
    rule = models.CharField(max_length=8, choices=Rule.choices, default=Rule.FAIL)
    join_kind = models.CharField(max_length=64)
    join_params = models.JSONField(default=dict, blank=True)
    join_priority = models.SmallIntegerField(default=0)
    join_queue = models.CharField(max_length=64, default="default")
    join_max_attempts = models.PositiveIntegerField(default=5)
    tenant_key = models.CharField(max_length=64, default="", blank=True)
    join = models.OneToOneField(
        "jobs.Job",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="joined_group",
    )
    created_at = models.DateTimeField(default=timezone.now)
    joined_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(
        null=True, blank=True, help_text="its parent was cancelled: the join does not run"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["parent", "name"], name="jobs_group_one_per_name"),
            models.CheckConstraint(
                condition=Q(ended__lte=F("size")), name="jobs_group_ended_bounded"
            ),
        ]
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"group {self.name} of job {self.parent_id}: {self.ended}/{self.size} ended"
