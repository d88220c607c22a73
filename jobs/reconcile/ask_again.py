"""Ask again for a job a failover lost, under the uid the outside world knows it by.

The lost job's manifest (``jobs.manifests``) gives its kind, subject, revision, tenant and
params; ``jobs.request``, the one idempotent way to ask, makes the row, with the lost
job's uid (``identity.restoring``): its artifact key, object name, effect ids and
idempotency keys derive as they did, so a notice the provider accepted before the
failover is the same effect under the same key. The row is marked ``reconciled_at``
in the same transaction, before any worker can see it: each of its external effects is
looked up by its key before it is sent (``jobs.delivery.release``), so a notice the
provider has is recorded as applied with the provider's reference, never sent twice.
"""

from __future__ import annotations

import uuid

from django.apps import apps
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from jobs import api, hooks, registry
from jobs.exceptions import UnknownKind
from jobs.identity import restoring
from jobs.manifests import Manifest
from jobs.models import Job, JobEvent

ACTOR = "jobs_reconcile"

# What became of one lost job.
REQUESTED = "asked_again"  # a new row under its uid: it runs again
ASKED_ALREADY = "asked_already"  # a job of that identity exists (asked for since)
SUBJECT_GONE = "subject_gone"  # its subject no longer exists: reported only
SUBJECT_UNKNOWN = "subject_unknown"  # the app cannot tell whether its subject exists
NO_IDENTITY = "no_identity"  # no readable manifest (or made before 0024): reported only
KIND_UNKNOWN = "kind_unknown"  # its kind is not registered here


def subject_exists(subject_type: str, subject_id: str) -> bool | None:
    """Whether the subject is still there: a model label (``app.model``) is looked up by
    primary key; a type a site registered (``jobs.hooks``) by its labels; else None."""
    try:
        model = apps.get_model(subject_type)
    except (LookupError, ValueError):
        model = None
    if model is not None:
        try:
            return model._default_manager.filter(pk=subject_id).exists()
        except (ValueError, TypeError, ValidationError):
            return False
    subject_hooks = hooks.SUBJECTS.get(subject_type)
    if subject_hooks is not None:
        return bool(subject_hooks.labels([subject_id]))
    return None


def ask_again(manifest: Manifest | None, *, dry_run: bool = False) -> tuple[str, int | None]:
    """Ask for the lost job again where its subject exists; (outcome, job id or None)."""
    if manifest is None or manifest.uid.isdigit():
        return NO_IDENTITY, None
    try:
        registry.get_kind(manifest.kind)
    except UnknownKind:
        return KIND_UNKNOWN, None
    exists = subject_exists(manifest.subject_type, manifest.subject_id)
    if exists is None:
        return SUBJECT_UNKNOWN, None
    if not exists:
        return SUBJECT_GONE, None
    if dry_run:
        return REQUESTED, None
    try:
        with transaction.atomic():
            with restoring(uuid.UUID(manifest.uid)):
                handle = api.request(
                    manifest.kind,
                    (manifest.subject_type, manifest.subject_id),
                    revision=manifest.revision,
                    params=manifest.params,
                    tenant=manifest.tenant,
                    priority=manifest.priority,
                    queue=manifest.queue,
                )
            if not handle.created:
                return ASKED_ALREADY, handle.id
            _mark(handle.id, note="asked again after a failover lost it")
    except (api.JobConflict, IntegrityError):
        existing = Job.objects.filter(
            kind=manifest.kind,
            subject_type=manifest.subject_type,
            subject_id=manifest.subject_id,
            output_revision=manifest.revision,
        ).first()
        return ASKED_ALREADY, existing.pk if existing else None
    return REQUESTED, handle.id


def mark(job_ids: list[int]) -> int:
    """Mark jobs whose sends the provider may have had before the failover; their count."""
    marked = 0
    for pk in job_ids:
        with transaction.atomic():
            marked += _mark(pk, note="the outside world may have its effects")
    return marked


def _mark(pk: int, *, note: str) -> int:
    """Set ``reconciled_at`` (not a state change: the version stays) and say so in the
    job's history."""
    won = Job.objects.filter(pk=pk, reconciled_at__isnull=True).update(reconciled_at=Now())
    if won:
        state, version = Job.objects.filter(pk=pk).values_list("state", "version").get()
        JobEvent.objects.create(
            job_id=pk,
            action="reconcile",
            actor=ACTOR,
            from_state=state,
            to_state=state,
            version=version,
            note=note,
        )
    return won
