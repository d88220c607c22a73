"""What the measured runs enqueue: bare no-ops, the engine's kinds, their plain twins.

Everything is enqueued before the cluster starts (one transaction per batch:
the queue is full when the first worker looks), so a run measures how fast
workers drain it, not how fast this process fills it.
"""

from __future__ import annotations

import io
import os
import uuid

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import transaction
from django_q.models import Task
from django_q.tasks import async_task

import jobs
from bench import plain
from bench.models import PlainNotice, ensure_table
from jobs.models import Artifact, Effect, Job, Notice
from permits.models import PermitRequest
from permits.reports import reviewers_of
from permits.services import report_request

BENCH_USER = "bench-recipient"
SUMMARY = "demo.summary"
REPORT = "permits.report"
# The permits' output revision is raised so that many report jobs (one per
# permit and revision) can be asked for; read_policy refuses revisions above it.
MAX_REVISION = 100_000


def prepare_database() -> int:
    """Migrate, seed the demo (offices, reviewers, permits); return the bench recipient's id."""
    call_command("migrate", verbosity=0, interactive=False)
    call_command("seed_demo", stdout=io.StringIO())
    ensure_table()
    PermitRequest.objects.update(output_revision=MAX_REVISION)
    user, _ = get_user_model().objects.get_or_create(username=BENCH_USER)
    return user.pk


def enqueue_noop(n: int) -> None:
    """N bare django-q2 tasks that do nothing, on the same queue the engine uses."""
    with transaction.atomic():
        for _ in range(n):
            async_task("bench.noop.noop")


def enqueue_plain_minimal(n: int, user_id: int) -> int:
    """N plain tasks doing the minimal kind's work (``bench.plain``); the notices expected."""
    tag = uuid.uuid4().hex[:8]
    with transaction.atomic():
        for i in range(n):
            async_task("bench.plain.plain_minimal", user_id, tag, i)
    return n


def enqueue_plain_reports(n: int) -> int:
    """N plain tasks doing the report's work, spread over the permits as reports are."""
    permits = list(PermitRequest.objects.select_related("tenant").order_by("pk"))
    reviewers = {p.pk: len(reviewers_of(p)) for p in permits}
    notices = 0
    with transaction.atomic():
        for i in range(n):
            permit = permits[i % len(permits)]
            async_task("bench.plain.plain_report", permit.pk, 1 + i // len(permits))
            notices += reviewers[permit.pk]
    return notices


def enqueue_summaries(
    n: int, user_id: int, *, tag: str | None = None, tenants: int = 0, sequences: int = 0
) -> list[int]:
    """N jobs of the minimal kind, through the public ``jobs.request``: of tenant ``bench``,
    or interleaved over ``tenants`` tenants (every claim contended), each in one of
    ``sequences`` sequences (item ``i`` in ``seq-<i % sequences>``) when asked for."""
    tag = tag or uuid.uuid4().hex[:8]
    ids = []
    with transaction.atomic():
        for i in range(n):
            job = jobs.request(
                SUMMARY,
                ("bench.item", f"{tag}-{i}"),
                tenant=f"t{i % tenants}" if tenants else "bench",
                params={"notify_user_id": user_id},
                sequence_key=f"seq-{i % sequences}" if sequences else None,
            ).job
            ids.append(job.pk)
    return ids


def enqueue_reports(n: int, *, first_revision: int = 1) -> list[int]:
    """N permit report jobs (PDF + one notice per reviewer), spread over the seeded permits."""
    permits = list(PermitRequest.objects.select_related("tenant").order_by("pk"))
    ids = []
    with transaction.atomic():
        for i in range(n):
            permit = permits[i % len(permits)]
            job, _ = report_request(permit, revision=first_revision + i // len(permits))
            ids.append(job.pk)
    return ids


def outcome_counts() -> dict[str, int]:
    """What a run left behind, to check every job really went through the engine."""
    return {
        "succeeded": Job.objects.filter(state=Job.State.SUCCEEDED).count(),
        "jobs": Job.objects.count(),
        "artifacts": Artifact.objects.count(),
        "effects_applied": Effect.objects.filter(state=Effect.State.APPLIED).count(),
        "effects": Effect.objects.count(),
        "notices": Notice.objects.count(),
    }


def plain_outcome_counts(expected_notices: int) -> dict[str, int]:
    """What a plain run left behind: files, notices, and tasks django-q2 saw fail."""
    root = plain.artifact_root() / "plain"
    files = sum(
        1 for _, _, names in os.walk(root) for name in names if not name.startswith(".tmp-")
    )
    return {
        "files": files,
        "notices": PlainNotice.objects.count(),
        "expected_notices": expected_notices,
        "failed": Task.objects.filter(success=False).count(),
    }
