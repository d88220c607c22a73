"""A filesystem artifact storage that fails with EIO or ESTALE: an outage, as a full disk is.

The fault is injected where the disk would give it: the storage's own system calls
(the fsync of the new file, the hard link that names it) fail with the errno while
the fault lasts, for paths under the artifact root only. The job waits out the
outage without spending its attempt budget (``test.short`` has 3), and succeeds by
itself once the storage works again.
"""

from __future__ import annotations

import errno
import os
from datetime import timedelta
from pathlib import Path

import pytest
from django.db.models.functions import Now
from django.utils import timezone

from jobs import artifacts
from jobs.delivery.runner import run_delivery
from jobs.exceptions import StorageUnavailable
from jobs.models import Artifact, Attempt, Job
from jobs.retry import classify
from tests.jobs.helpers import make_due, new_job

pytestmark = pytest.mark.django_db(transaction=True)


class DiskFault:
    """``os.fsync`` and ``os.link`` fail with ``code`` for files under ``root`` while on."""

    def __init__(self, monkeypatch, root: Path, code: int) -> None:
        self.root, self.code, self.on, self.hits = str(root), code, True, 0
        real_fsync, real_link = os.fsync, os.link

        def fsync(fd):
            if self.on and os.readlink(f"/proc/self/fd/{fd}").startswith(self.root):
                self.hits += 1
                raise OSError(self.code, os.strerror(self.code))
            return real_fsync(fd)

        def link(src, dst, *args, **kwargs):
            if self.on and str(dst).startswith(self.root):
                self.hits += 1
                raise OSError(self.code, os.strerror(self.code), str(dst))
            return real_link(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "link", link)


@pytest.fixture
def root() -> Path:
    return Path(artifacts.get_storage().location).resolve()


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE])
def test_store__a_storage_write_failing_with_a_disk_error_is_storage_unavailable(
    monkeypatch, root, code
):
    job = new_job(kind="test.short")
    DiskFault(monkeypatch, root, code)
    with pytest.raises(StorageUnavailable) as raised:
        artifacts.store(job, b"bytes", content_type="text/plain", extension="txt")
    name = errno.errorcode[code]
    assert str(raised.value) == f"artifact storage write failed ({name})", "no path in it"
    c = classify(raised.value)
    assert (c.code, c.outage) == (f"storage_{name.lower()}", True)
    leftovers = [p for p in root.rglob(f"{artifacts.artifact_key(job)}-*")]
    assert leftovers == [], "no temporary file, no half-written name"


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE])
def test_delivery__storage_eio_waits_without_spending_attempts_then_succeeds(
    monkeypatch, root, code
):
    job = new_job(kind="test.short")
    budget = job.max_attempts
    assert budget == 3
    fault = DiskFault(monkeypatch, root, code)
    outage_tries = budget + 2  # more than the whole budget
    for _ in range(outage_tries):
        result = run_delivery(job.pk, worker="w1")
        assert result.outcome == "retry", result
        job.refresh_from_db()
        assert job.state == Job.State.RETRY_WAIT, "an outage never kills a job"
        make_due(job)
    assert fault.hits >= outage_tries
    job.refresh_from_db()
    name = errno.errorcode[code]
    assert job.last_error_code == f"storage_{name.lower()}"
    assert job.outage_since is not None
    # No attempt spent: the budget grew by every attempt the outage cost.
    assert (job.attempts, job.max_attempts) == (outage_tries, budget + outage_tries)

    fault.on = False  # the storage works again
    result = run_delivery(job.pk, worker="w1")
    assert result.outcome == "succeeded", result
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED and job.outage_since is None
    assert job.max_attempts - job.attempts == budget - 1, "one attempt of the budget spent"
    outcomes = list(Attempt.objects.filter(job=job).values_list("outcome", "error_code"))
    assert outcomes == [("retry", f"storage_{name.lower()}")] * outage_tries + [("succeeded", "")]
    row = Artifact.objects.get(job=job)
    assert artifacts.read_verified(row).startswith(f"artifact of job {job.pk}".encode())


def test_outage_over__the_first_job_to_succeed_wakes_those_still_backing_off(monkeypatch, root):
    """Three jobs meet the storage away and back off (up to a minute); the storage works
    again; the first of them to succeed makes the other two due at once (not at the end
    of their backoff), with their grown budgets kept. A job backing off from another
    outage keeps its due time."""
    first, second, third = (new_job(kind="test.short", subject=str(n)) for n in range(3))
    other = new_job(kind="test.short", subject="other")
    fault = DiskFault(monkeypatch, root, errno.EIO)
    for job in (first, second, third):
        assert run_delivery(job.pk, worker="w1").outcome == "retry"
    assert run_delivery(other.pk, worker="w1").outcome == "retry"
    # ``other`` waits out another outage (its code says which).
    Job.objects.filter(pk=other.pk).update(last_error_code="db_unavailable")
    backing_off = Job.objects.filter(pk__in=[second.pk, third.pk, other.pk])
    backing_off.update(next_attempt_at=timezone.now() + timedelta(seconds=60))
    make_due(first)

    fault.on = False  # the storage is back
    assert run_delivery(first.pk, worker="w1").outcome == "succeeded"

    woken = Job.objects.filter(pk__in=[second.pk, third.pk], next_attempt_at__lte=Now())
    assert woken.count() == 2, "both are due now"
    assert set(woken.values_list("state", "max_attempts")) == {(Job.State.RETRY_WAIT, 4)}
    assert Job.objects.get(pk=other.pk).next_attempt_at > timezone.now() + timedelta(seconds=30)
    for job in (second, third):
        assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
