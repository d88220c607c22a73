"""Downloads stream with flat memory (issue 23), and never serve bytes that fail verification.

The reviewer download reads through ``open_verified``: the bytes are hashed while
they are copied into a spool (a temporary file past 1 MiB) and served from it only
once the whole file matched. The resident set size of this process is sampled while
a 200 MB report is downloaded; it must not grow by anything near the file's size.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest
from django.contrib.auth.models import Group
from django.test import Client

from jobs import artifacts
from jobs.delivery.runner import run_delivery
from jobs.models import Artifact
from jobs.testing.s3server import moto_server_process
from permits.services import report_request
from tests.permits import factories

pytestmark = pytest.mark.django_db

MB = 1024 * 1024


def rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")  # pragma: no cover - Linux only


class PeakRSS(threading.Thread):
    """Samples this process's resident set size every 5 ms until stopped."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = rss()
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.join()


def big_report(make_user, size: int, put) -> tuple:
    """A finished report whose published bytes are ``size`` bytes (written in chunks)."""
    reviewer = make_user(username=f"big-{size}")
    reviewer.groups.add(Group.objects.get(name="reviewers"))
    permit = factories.permit(reviewer=reviewer)
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "succeeded"
    artifact = Artifact.objects.get(job=job)
    chunk = os.urandom(MB)
    digest = hashlib.sha256()
    for _ in range(size // MB):
        digest.update(chunk)
    put(artifact.storage_name, chunk, size // MB)
    Artifact.objects.filter(pk=artifact.pk).update(sha256=digest.hexdigest(), size=size)
    return reviewer, permit, digest.hexdigest(), artifact.storage_name


def download(reviewer, permit) -> tuple[int, str, int]:
    """Status, sha256 of the body, and how much the RSS grew while it streamed."""
    client = Client()
    client.force_login(reviewer)
    base = rss()
    with PeakRSS() as peak:
        response = client.get(f"/requests/{permit.pk}/report/")
        digest = hashlib.sha256()
        if response.streaming:
            for part in response.streaming_content:
                digest.update(part)
        else:
            digest.update(response.content)
        response.close()
    return response.status_code, digest.hexdigest(), peak.peak - base


def test_download__200_mb_report_streams_with_flat_memory(make_user):
    storage = artifacts.get_storage()

    def put(name, chunk, count):
        with open(storage.path(name), "wb") as fh:
            for _ in range(count):
                fh.write(chunk)

    reviewer, permit, sha, _ = big_report(make_user, 200 * MB, put)
    status, served, grew = download(reviewer, permit)
    print(f"200 MB download (filesystem): RSS grew {grew / MB:.1f} MB")
    assert status == 200 and served == sha
    assert grew < 40 * MB, f"RSS grew {grew / MB:.0f} MB for a 200 MB download"


def test_download__bytes_failing_verification_are_never_served(make_user):
    storage = artifacts.get_storage()

    def put(name, chunk, count):
        with open(storage.path(name), "wb") as fh:
            for _ in range(count):
                fh.write(chunk)

    reviewer, permit, sha, name = big_report(make_user, 8 * MB, put)
    with open(storage.path(name), "r+b") as fh:
        fh.seek(8 * MB - 1)
        last = fh.read(1)
        fh.seek(8 * MB - 1)
        # The last byte, flipped: everything before it would pass. (Writing a fixed 0x00
        # changed nothing when the random chunk already ended in one: 1 run in 256.)
        fh.write(bytes([last[0] ^ 0xFF]))
    status, served, _ = download(reviewer, permit)
    assert status == 503 and served != sha


@pytest.fixture(scope="module")
def s3_process():
    with moto_server_process() as server:
        yield server


def test_download__64_mb_report_streams_from_s3_with_flat_memory(make_user, settings, s3_process):
    settings.JOBS_LEASE_SECONDS = 15  # the delivery uploads over HTTP on a loaded machine
    bucket = s3_process.create_bucket("big-reports")
    settings.STORAGES = {**settings.STORAGES, "artifacts": s3_process.storage_options(bucket)}
    client = s3_process.client()

    def put(name, chunk, count):
        # Multipart upload, one part per 8 MB: never the whole object in memory here.
        upload = client.create_multipart_upload(Bucket=bucket, Key=name)
        parts = []
        for n in range(count // 8):
            etag = client.upload_part(
                Bucket=bucket,
                Key=name,
                UploadId=upload["UploadId"],
                PartNumber=n + 1,
                Body=chunk * 8,
            )["ETag"]
            parts.append({"PartNumber": n + 1, "ETag": etag})
        client.complete_multipart_upload(
            Bucket=bucket,
            Key=name,
            UploadId=upload["UploadId"],
            MultipartUpload={"Parts": parts},
        )

    reviewer, permit, sha, _ = big_report(make_user, 64 * MB, put)
    status, served, grew = download(reviewer, permit)
    print(f"64 MB download (S3): RSS grew {grew / MB:.1f} MB")
    assert status == 200 and served == sha
    assert grew < 30 * MB, f"RSS grew {grew / MB:.0f} MB for a 64 MB download"
