"""The pieces of jobs.supervisor that run inside one process: deliveries, outages, figures.

The processes themselves (jobs_worker, jobs_dispatcher) are tested for real in
tests/e2e/test_outages.py.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time

import pytest
from django.db import OperationalError
from django.utils import timezone
from django_q.models import Task

from jobs import conf, stats, supervisor
from jobs.exceptions import DeliveryFailed
from jobs.supervisor import PROGRESS_FILE_ENV, Outage, delivery

PRIVATE = "Ada Zzprivzz"


def test_delivery__a_failure_is_named_by_class_and_code_only(caplog):
    caplog.set_level(logging.WARNING, logger="jobs.supervisor")
    with pytest.raises(DeliveryFailed) as raised, delivery("run_job", 12):
        raise OperationalError(f'duplicate key (applicant)=({PRIVATE}) already exists"')
    assert str(raised.value) == "run_job 12: OperationalError db_unavailable"
    assert raised.value.__suppress_context__  # django-q2's traceback text stops here
    assert "run_job 12: delivery failed before an outcome was recorded" in caplog.text
    assert PRIVATE not in caplog.text


def test_delivery__marks_progress_when_it_begins_and_ends(tmp_path, monkeypatch):
    progress = tmp_path / "progress"
    progress.touch()
    os.utime(progress, (0, 0))
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(progress))
    with delivery("release_effect", 3):
        began = progress.stat().st_mtime
        os.utime(progress, (0, 0))
    assert began > time.time() - 60
    assert progress.stat().st_mtime > time.time() - 60


def test_outage__logged_once_when_it_begins_and_once_when_it_ends(caplog):
    caplog.set_level(logging.INFO, logger="jobs.supervisor")
    outage = Outage("test_loop", cap=0.5)
    assert outage.recovered() is None  # nothing to end
    delays = [outage.failed(OperationalError("connection refused")) for _ in range(4)]
    assert all(0 < d <= 0.5 for d in delays)
    assert outage.down
    seconds = outage.recovered()
    assert seconds is not None and not outage.down
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "test_loop: database unavailable (OperationalError db_unavailable) on host "
        f"{conf.host_name()}; retrying with backoff up to 0.5s",
        f"test_loop: database back after {seconds:.1f} s (4 failed tries)",
    ]


@pytest.mark.django_db
@pytest.mark.urls("tests.testapp.urls")
def test_failed_deliveries__counted_in_stats_metrics_and_dashboard(client, admin_user):
    now = timezone.now()

    def task(name: str, func: str, *, success: bool, attempts: int) -> None:
        Task.objects.create(
            id=name,
            name=name,
            func=func,
            started=now,
            stopped=now,
            success=success,
            attempt_count=attempts,
            result="",
        )

    task("a", "jobs.tasks.run_job", success=False, attempts=2)
    task("b", "jobs.tasks.run_job", success=False, attempts=1)
    task("c", "jobs.tasks.release_effect", success=False, attempts=1)
    task("d", "jobs.tasks.run_job", success=True, attempts=1)  # saved success: not a failure
    task("e", "someone.else", success=False, attempts=5)  # not ours

    figures = stats.collect()
    assert figures["failed_deliveries"] == 4
    assert figures["failed_deliveries_by_task"] == {"run_job": 3, "release_effect": 1}

    client.force_login(admin_user)
    text = client.get("/metrics").content.decode()
    assert 'jobs_failed_deliveries_total{task="run_job"} 3.0' in text
    assert 'jobs_failed_deliveries_total{task="release_effect"} 1.0' in text
    page = client.get("/admin/jobs/job/dashboard/").content.decode()
    assert re.search(r'<dd id="failed-deliveries"><a [^>]*>4</a></dd>', page), page


def test_idle__a_cluster_that_has_delivered_nothing_yet_gets_its_boot_grace(tmp_path):
    """On a loaded host a cluster can take longer than the stall time to boot: until its
    first delivery, idleness counts from the end of the boot grace, then from progress."""
    from jobs.supervisor import Options, Supervisor

    sup = Supervisor(Options(stall_seconds=8, boot_grace=30), command=["true"])
    try:
        now = time.time()
        sup.started_at = now - 20  # booting for 20 s, nothing delivered yet
        os.utime(sup.progress, (now - 100, now - 100))
        assert sup._idle_seconds() < 0, "still within its boot grace: not stalled"
        sup.started_at = now - 45  # 15 s past the grace, still nothing
        assert 14 < sup._idle_seconds() < 16
        os.utime(sup.progress, (now - 10, now - 10))  # a delivery 10 s ago
        assert 9 < sup._idle_seconds() < 11, "after a delivery, idleness counts from it"
    finally:
        sup.progress.unlink(missing_ok=True)


def test_within__a_look_that_gets_no_answer_is_an_outage_in_seconds(caplog):
    """A connection cut without a word blocks its query; the look gives up at its deadline,
    and while that look still waits the next one fails at once (one blocked thread)."""
    caplog.set_level(logging.WARNING, logger="jobs.supervisor")
    answered = threading.Event()
    started = time.monotonic()
    with pytest.raises(OperationalError, match=r"did not answer in 0\.3 s"):
        supervisor.within(0.3, lambda: answered.wait(30))
    assert 0.3 <= time.monotonic() - started < 2
    started = time.monotonic()
    with pytest.raises(OperationalError, match="an earlier look still waits"):
        supervisor.within(0.3, lambda: "never run")
    assert time.monotonic() - started < 0.2, "no second thread blocks behind the first"
    outage = Outage("test_loop")
    try:
        supervisor.within(0.3, lambda: "never run")
    except OperationalError as exc:
        outage.failed(exc)
    assert "test_loop: database unavailable (OperationalError db_unavailable) on host" in (
        caplog.text
    )
    answered.set()  # the blocked look ends: the next look runs on a new thread
    deadline = time.monotonic() + 5
    while True:
        try:
            assert supervisor.within(2, lambda: "answer") == "answer"
            break
        except OperationalError:
            assert time.monotonic() < deadline, "the blocked look never ended"
            time.sleep(0.05)
    assert supervisor.within(None, lambda: 7) == 7, "no deadline: run in place"


@pytest.mark.django_db
def test_messages_waiting__where_the_table_is_the_queue__a_job_due_and_untaken(
    monkeypatch, django_user_model
):
    """Under a claiming broker a job has no message: the stall watch's sign is a job of the
    served queues due for over ``grace`` seconds that no claim took or held back (one due
    later, held by a pause, or of another queue is none)."""
    from datetime import timedelta

    from django_q.conf import Conf

    import jobs
    from jobs.models import Job

    monkeypatch.setattr(Conf, "BROKER_CLASS", "jobs.claiming.ClaimingBroker")
    monkeypatch.setattr(Conf, "SYNC", False)
    job = jobs.request("test.steps", ("auth.user", 1), params={"recipients": []}).job
    assert supervisor.messages_waiting(stall=30, grace=5) == "", "due for less than grace"
    ago = timezone.now() - timedelta(seconds=10)
    Job.objects.filter(pk=job.pk).update(created_at=ago, next_attempt_at=ago)
    assert supervisor.messages_waiting(stall=30, grace=5) == (
        "1 job(s) due for over 5 s and not claimed"
    )
    Job.objects.filter(pk=job.pk).update(held_by="kind:test.steps")
    assert supervisor.messages_waiting(stall=30, grace=5) == ""
    Job.objects.filter(pk=job.pk).update(held_by="", queue="reports")
    assert supervisor.messages_waiting(stall=30, grace=5) == ""
    assert supervisor.messages_waiting(stall=30, grace=5, keys=[f"{Conf.PREFIX}.reports"])
