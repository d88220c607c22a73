"""The compact record an archived job leaves behind (issue 46): its identity, forever.

The archive pass (``jobs.archive``) deletes a long-finished job's rows (the job, its
attempts, steps, events, artifact row, settled effects and their events) and keeps this
one row in their place: what makes a second request for the same (kind, subject,
revision) return the same job id and final state, what names the published artifact
file (so no pruning deletes it) and, for each effect, the idempotency key it was sent
under and its outcome (so the provider never sees it under another key). Part of
``jobs.models``.

The primary key is the job's uid, not its id: a failover's rewound sequence can hand an
id out again (``jobs.identity``), a uid never.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from jobs.identity import tokens_lookup


class ArchivedJob(models.Model):
    """One archived job's identity, final state, artifact and effect outcomes."""

    uid = models.UUIDField(primary_key=True, editable=False)
    job_id = models.PositiveBigIntegerField(help_text="the job's id (its readable name)")
    keys_from_id = models.BooleanField(
        default=False, help_text="made before migration 0024: its keys derive from its id"
    )
    kind = models.CharField(max_length=64)
    subject_type = models.CharField(max_length=100)
    subject_id = models.CharField(max_length=64)
    output_revision = models.PositiveIntegerField()
    state = models.CharField(max_length=16, help_text="its final state")
    finished_at = models.DateTimeField(null=True)
    artifact_key = models.CharField(max_length=200, blank=True, default="")
    artifact_name = models.CharField(
        max_length=300, blank=True, default="", help_text="the storage name of its file"
    )
    artifact_sha256 = models.CharField(max_length=64, blank=True, default="")
    artifact_size = models.PositiveBigIntegerField(null=True)
    artifact_content_type = models.CharField(max_length=100, blank=True, default="")
    # {effect_id: [idempotency_key, final state]}: read with the record, never queried
    # by itself (an effect id names its job's key, so its record is found by uid).
    effects = models.JSONField(default=dict, blank=True)
    archived_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "subject_type", "subject_id", "output_revision"],
                name="jobs_archived_one_per_identity",
            ),
        ]
        indexes = [models.Index(fields=["job_id"], name="jobs_archived_job_id_idx")]
        ordering = ["-job_id"]

    def __str__(self) -> str:
        return f"archived job {self.job_id} {self.kind} r{self.output_revision} ({self.state})"

    @property
    def job_key(self) -> str:
        """What the job's keys and object names derived from (``identity.job_key``)."""
        return str(self.job_id) if self.keys_from_id else str(self.uid)


def known_tokens(tokens: set[str]) -> set[str]:
    """The job keys among ``tokens`` (uids, or ids before 0024) an archived job had: their
    files are kept, and their jobs are not lost (``jobs.reconcile``, ``jobs.retention``)."""
    named = tokens_lookup(tokens, id_field="job_id")
    if named is None:
        return set()
    rows = ArchivedJob.objects.filter(named).only("uid", "job_id", "keys_from_id")
    return {row.job_key for row in rows}


def kept_names(names: list[str]) -> set[str]:
    """Those of ``names`` an archived job's record names (its file): never orphans. Asked
    for the candidates only, a thousand a query: the records grow forever."""
    kept: set[str] = set()
    for start in range(0, len(names), 1000):
        chunk = names[start : start + 1000]
        rows = ArchivedJob.objects.filter(artifact_name__in=chunk)
        kept.update(rows.values_list("artifact_name", flat=True))
    return kept
