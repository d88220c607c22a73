"""The flow rules' audit history: who changed a rule, from what to what. Part of
``jobs.models``."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class FlowRuleChange(models.Model):
    """Who changed a flow rule, from what to what (the audit history; invariant 10)."""

    scope = models.CharField(max_length=200)
    action = models.CharField(max_length=16)  # set | pause | resume | delete | circuit
    actor = models.CharField(max_length=200)
    before = models.CharField(max_length=300, blank=True, default="")
    after = models.CharField(max_length=300, blank=True, default="")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["scope", "at"], name="jobs_flowchange_scope_idx")]

    def __str__(self) -> str:
        return f"{self.action} {self.scope} by {self.actor}"
