"""Artifact storage full, then freed: jobs wait out the outage and finish without an operator.

A real full file system: a small tmpfs mounted as the artifact root (we run as root
here, as CI does), filled with a ballast file; real qcluster and dispatcher processes.
"""

from __future__ import annotations

import errno
import os
import time

import pytest

from jobs.models import Attempt, Job
from tests.chaos.soak import FullDisk
from tests.e2e.processes import wait_until
from tests.jobs.helpers import request_job

OUTAGE_SECONDS = float(os.environ.get("STORAGE_OUTAGE_SECONDS", "20"))  # 60 s: see the #10 note
JOBS = 10


@pytest.fixture
def full_disk(tmp_path):
    disk = FullDisk(tmp_path / "artifacts", size="512k")
    if not disk.mount():
        pytest.fail("cannot mount a tmpfs for the artifact root (root is needed, as in CI)")
    try:
        disk.begin()
        with pytest.raises(OSError) as full:
            (disk.root / "probe").write_bytes(b"x" * 8192)
        assert full.value.errno == errno.ENOSPC
        (disk.root / "probe").unlink(missing_ok=True)
        yield disk
    finally:
        disk.unmount()


@pytest.mark.drill
def test_artifact_storage_full_then_freed__every_job_succeeds_without_an_operator(procs, full_disk):
    root = full_disk.root
    procs.env["ARTIFACT_ROOT"] = str(root)
    for n in range(JOBS):
        request_job("test.steps", subject_type="auth.user", subject_id=n, tenant_key=f"t{n % 3}")
    procs.start("qcluster", "qcluster")
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.5")
    started = time.monotonic()
    wait_until(
        procs,
        "every job to have met the full disk",
        lambda: Job.objects.filter(last_error_code="storage_enospc").count() == JOBS,
        timeout=60,
    )
    while time.monotonic() - started < OUTAGE_SECONDS:
        assert not Job.objects.filter(state__in=[Job.State.DEAD, Job.State.FAILED]).exists(), (
            "an outage must not kill jobs"
        )
        time.sleep(1)
    stopped = Attempt.objects.filter(error_code="storage_enospc")
    details = set(Job.objects.values_list("last_error_detail", flat=True))
    print(f"storage full for {time.monotonic() - started:.0f} s: {stopped.count()} attempts hit it")
    assert details == {"storage unavailable: No space left on device (ENOSPC)"}, details
    assert not Job.objects.filter(state__in=[Job.State.DEAD, Job.State.FAILED]).exists()

    full_disk.end()  # space comes back
    freed = time.monotonic()
    wait_until(
        procs,
        "every job to succeed once the space is back",
        lambda: Job.objects.filter(state=Job.State.SUCCEEDED).count() == JOBS,
        timeout=90,
    )
    print(f"all {JOBS} jobs succeeded {time.monotonic() - freed:.1f} s after the space came back")
    for job in Job.objects.all():
        assert job.attempts <= job.max_attempts and job.outage_since is None
    files = [f for f in (root / "jobs").rglob("*") if f.is_file() and f.parent.name != ".identity"]
    assert len(files) == JOBS, f"one artifact per job, no temporary leftovers: {files}"
