"""Same-work baselines: the engine's kinds written as a naive django-q2 task would be.

Each task does the work its engine kind does, with the same ORM reads, the same
rendering and the same file write, but none of the engine: no Job row, no
lease, no compare-and-set, no ledger, no attempt rows. Enqueued with
``async_task`` exactly like ``bench.noop.noop``, so the engine's throughput over
these is the price of exactly-once effects for the same work.

- ``plain_minimal``: ``demo.summary`` (``permits.jobkinds``): read the user by
  pk, a small text body, one file, one in-app notice row.
- ``plain_report``: ``permits.report`` (``permits.reports``): read the permit
  with its tenant, the same policy check and PDF, one file, then one notice
  per reviewer found by the same django-guardian lookup.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.utils import timezone

from bench.models import PlainNotice
from permits import reports
from permits.models import PermitRequest

# jobs.artifacts fsyncs the file before linking it into place and, since the outage
# rule (a634bf3), the folder after the link; the baselines do the same, so that the
# comparison holds the durability work equal (until this session they still fsynced
# the file only, which left the engine 0.3 ms of disk waits a job behind).
FSYNC_FILE = True
FSYNC_DIR = True


def artifact_root() -> Path:
    """The folder the engine stores artifacts in (the ``artifacts`` storage's location)."""
    return Path(settings.STORAGES["artifacts"]["OPTIONS"]["location"])


def write_file(
    name: str, data: bytes, *, fsync_file: bool = FSYNC_FILE, fsync_dir: bool = FSYNC_DIR
) -> str:
    """Write ``data`` under ``name`` in the artifact root atomically; return its sha256.

    A temporary file in the target folder, fsynced, then renamed into place, as
    the engine's storage does (it links instead of renaming, to refuse a second
    writer: one system call more, nothing a naive task would bother with).
    """
    path = artifact_root() / name
    folder = path.parent
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if fsync_file:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if fsync_dir:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return hashlib.sha256(data).hexdigest()


def plain_minimal(user_id: int, tag: str, i: int) -> str:
    """``demo.summary``'s work without the engine: read the user, write a file, one notice."""
    user = get_user_model().objects.filter(pk=user_id).first()
    if user is None:
        raise ValueError(f"no user {user_id}")
    body = (
        f"Summary for bench.item {tag}-{i}, revision 1\n"
        f"Generated for item {i} at {timezone.now().isoformat()}\n"
    ).encode()
    digest = write_file(f"plain/demo-summary/item-{tag}-{i}-rev-1.txt", body)
    PlainNotice.objects.create(recipient=user, title=f"Summary ready: item {i} revision 1")
    return digest


@dataclass
class ReportRequest:
    """What ``render_report`` and ``read_policy`` read from a job, without a Job row."""

    pk: int
    output_revision: int
    created_at: datetime
    tenant_key: str


def plain_report(permit_id: int, revision: int) -> str:
    """``permits.report``'s work without the engine: permit, policy, PDF, file, notices."""
    permit = PermitRequest.objects.select_related("tenant").filter(pk=permit_id).first()
    if permit is None:
        raise ValueError(f"no permit request {permit_id}")
    request = ReportRequest(revision, revision, timezone.now(), permit.tenant.key)
    reason = reports.read_policy(permit, request)
    if reason:
        raise PermissionError(reason)
    pdf = reports.render_report(permit, request)
    digest = write_file(f"plain/permits-report/permit-{permit.pk}-rev-{revision}.pdf", pdf)
    title = f"Report ready: {permit.reference} revision {revision}"
    link = f"/requests/{permit.pk}/"
    for user in reports.reviewers_of(permit):
        PlainNotice.objects.create(recipient=user, title=title, link=link)
    return digest


def in_process_ms(user_id: int, minimal: int = 40, report: int = 12) -> tuple[float, float]:
    """Median milliseconds of each plain task called in this process (to size the runs)."""
    permits = list(PermitRequest.objects.order_by("pk").values_list("pk", flat=True))
    plain_minimal(user_id, "warm", 0)
    plain_report(permits[0], 1)  # fonts, styles, imports
    samples_min, samples_rep = [], []
    for i in range(minimal):
        t = time.perf_counter()
        plain_minimal(user_id, "size", i)
        samples_min.append((time.perf_counter() - t) * 1000)
    for i in range(report):
        t = time.perf_counter()
        plain_report(permits[i % len(permits)], 2 + i // len(permits))
        samples_rep.append((time.perf_counter() - t) * 1000)
    samples_min.sort()
    samples_rep.sort()
    return samples_min[len(samples_min) // 2], samples_rep[len(samples_rep) // 2]
