"""Published bytes never change (issue 18): a stale worker adds an orphan, never a rewrite.

Real threads on PostgreSQL, each on its own connection; the lease runs out by time
travel (``expire_lease``). The test kind's bytes include the worker's identity, so two
workers of one job always produce different bytes.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from datetime import datetime, timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection

from jobs import artifacts, registry
from jobs.delivery.runner import run_delivery
from jobs.models import Artifact, Attempt, Job
from tests.jobs.helpers import expire_lease, new_job

try:  # Django 6
    from django.tasks import task
except ImportError:  # Django 5.2: the django-tasks backport
    from django_tasks import task

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

KIND = "test.per_worker"


def per_worker(ctx) -> list:
    """Render bytes that name the worker, mark a pause point, then store (no heartbeat)."""
    ctx.check_owner()
    body = f"job {ctx.job.pk} rendered by {ctx.worker}\n".encode()
    ctx.stage("rendered")
    ctx.store_artifact(body, content_type="text/plain", extension="txt")
    return []


@pytest.fixture(autouse=True)
def _kind():
    registry.register_kind(KIND, per_worker)


def bytes_of(worker: str, job: Job) -> bytes:
    return f"job {job.pk} rendered by {worker}\n".encode()


def stale_worker_race(pause_at: str) -> tuple[Job, dict]:
    """Worker A pauses at ``pause_at``; its lease runs out; B publishes; A resumes."""
    job = new_job(kind=KIND)
    paused, resume = threading.Event(), threading.Event()
    seen: dict = {}

    def hook(stage, ctx):
        if stage == "artifact_stored":
            seen.setdefault("names", {})[ctx.worker] = ctx.artifact.storage_name
        if stage == pause_at and ctx.worker == "A":
            paused.set()
            assert resume.wait(30)

    def worker_a():
        try:
            seen["A"] = run_delivery(job.pk, worker="A", on_stage=hook)
        finally:
            connection.close()

    thread = threading.Thread(target=worker_a)
    thread.start()
    try:
        assert paused.wait(30)
        expire_lease(job)
        seen["B"] = run_delivery(job.pk, worker="B", on_stage=hook)
        assert seen["B"].outcome == "succeeded"
        seen["published"] = Artifact.objects.get(job=job)
    finally:
        resume.set()
        thread.join(30)
    return job, seen


def assert_published_bytes_are_bs(job: Job, seen: dict) -> None:
    assert seen["A"].outcome == "lease_lost"
    (row,) = Artifact.objects.filter(job=job)
    assert row.pk == seen["published"].pk and row.sha256 == seen["published"].sha256
    expected = bytes_of("B", job)
    assert row.storage_name == seen["names"]["B"] != seen["names"]["A"]
    assert row.sha256 == artifacts.sha256_hex(expected)
    assert artifacts.read_verified(row) == expected
    assert Path(artifacts.get_storage().path(row.storage_name)).read_bytes() == expected
    # A's bytes went to their own file (an orphan), never over B's.
    orphan = Path(artifacts.get_storage().path(seen["names"]["A"]))
    assert orphan.read_bytes() == bytes_of("A", job)
    by_worker = dict(Attempt.objects.filter(job=job).values_list("worker", "outcome"))
    assert by_worker == {"A": "lease_lost", "B": "succeeded"}


def test_stale_worker__paused_before_it_stores__published_bytes_stay_the_winners():
    job, seen = stale_worker_race("rendered")
    assert_published_bytes_are_bs(job, seen)


def test_stale_worker__paused_after_it_stored__published_bytes_stay_the_winners():
    job, seen = stale_worker_race("artifact_stored")
    assert_published_bytes_are_bs(job, seen)


def test_store__identical_bytes_reuse_the_file_other_bytes_never_overwrite():
    job = new_job(kind=KIND)
    first = artifacts.store(job, b"one", content_type="text/plain", extension="txt")
    path = Path(artifacts.get_storage().path(first.artifact.storage_name))
    inode = os.stat(path).st_ino
    again = artifacts.store(job, b"one", content_type="text/plain", extension="txt")
    assert (again.artifact.storage_name, again.reused) == (first.artifact.storage_name, True)
    assert os.stat(path).st_ino == inode, "reused, not rewritten"

    path.write_bytes(b"torn")  # a corrupt file under the name of b"one"
    third = artifacts.store(job, b"one", content_type="text/plain", extension="txt")
    assert third.artifact.storage_name != first.artifact.storage_name and not third.reused
    assert path.read_bytes() == b"torn", "never overwritten"
    assert artifacts.read_verified(third.artifact) == b"one"


# --- the same through django.tasks ----------------------------------------------------------

_calls = itertools.count(1)
_pause = {"thread": None, "reached": threading.Event(), "resume": threading.Event()}


@task
def numbered() -> int:
    """1 for the first call, 2 for the second...; the paused thread stops before it returns."""
    value = next(_calls)
    if threading.current_thread() is _pause["thread"]:
        _pause["reached"].set()
        assert _pause["resume"].wait(30)
    return value


def test_jobs_backend__a_finished_tasks_return_value_never_changes_when_a_stale_worker_resumes():
    global _calls
    _calls = itertools.count(1)
    result = numbered.enqueue()
    job = Job.objects.get(pk=int(result.id))
    outcome = {}

    def worker_a():
        try:
            outcome["A"] = run_delivery(job.pk, worker="A")
        finally:
            connection.close()

    thread = threading.Thread(target=worker_a)
    _pause.update(thread=thread, reached=threading.Event(), resume=threading.Event())
    thread.start()
    try:
        assert _pause["reached"].wait(30)  # A computed 1 and is stuck before it stores
        expire_lease(job)  # a plain function cannot heartbeat
        assert run_delivery(job.pk, worker="B").outcome == "succeeded"
        result.refresh()
        assert result.return_value == 2
    finally:
        _pause["resume"].set()
        thread.join(30)
    assert outcome["A"].outcome == "lease_lost"
    result.refresh()
    assert result.return_value == 2, "the finished task's value is the published one"
    assert numbered.get_result(result.id).return_value == 2
    assert Artifact.objects.filter(job=job).count() == 1


# --- orphans: counted by jobs_stats, collected by jobs_prune after the grace period ---------


def stats() -> dict:
    out = StringIO()
    call_command("jobs_stats", "--json", stdout=out)
    return json.loads(out.getvalue())


def age(name: str, seconds: float) -> None:
    path = artifacts.get_storage().path(name)
    then = (datetime.now() - timedelta(seconds=seconds)).timestamp()
    os.utime(path, (then, then))


def test_orphans__a_late_writers_file_is_counted_then_pruned_after_the_grace_period(settings):
    settings.JOBS_ORPHAN_GRACE_SECONDS = 600
    job, seen = stale_worker_race("rendered")
    row = Artifact.objects.get(job=job)
    orphan = seen["names"]["A"]
    # A file of a job still running is no orphan: its next delivery may publish it.
    running = new_job(kind=KIND, subject=2)
    pending = artifacts.store(running, b"not yet published", content_type="t", extension="txt")
    age(pending.artifact.storage_name, 3600)

    assert stats()["artifacts"] == {"by_state": {"stored": 1}, "orphan_files": 1}
    call_command("jobs_prune", stdout=StringIO())
    assert artifacts.get_storage().exists(orphan), "inside the grace period: kept"

    age(orphan, 601)
    age(row.storage_name, 3600)  # old, but a row names it
    out = StringIO()
    call_command("jobs_prune", "--dry-run", stdout=out)
    assert "would delete 1 orphan artifact files" in out.getvalue()
    assert artifacts.get_storage().exists(orphan)
    out = StringIO()
    call_command("jobs_prune", stdout=out)
    assert "deleted 1 orphan artifact files" in out.getvalue()
    assert not artifacts.get_storage().exists(orphan)
    assert artifacts.is_intact(Artifact.objects.get(pk=row.pk)), "a named file is never pruned"
    assert artifacts.get_storage().exists(pending.artifact.storage_name)
    assert stats()["artifacts"]["orphan_files"] == 0
