"""Causes in plain words and only the actions that can help (issue 44).

A malformed payload fails at once and is offered neither "Fix the subject" nor a requeue
(the page says why nothing helps); the site's data error (a work type outside the choices)
is named in words with its field, on the job page, in the console and on the reviewer's
page; "Retry now" in a queue no worker serves says so with the command; a dead group
child's requeue says its join has already ended; the wording fixes hold.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.db.models.functions import Now
from django.utils import timezone

import jobs
from jobs.delivery.runner import run_delivery
from jobs.models import Attempt, Job, JobGroup
from jobs.ops import causes, verdict
from permits import reports
from permits.models import PermitRequest
from tests.permits.test_admin import demo, login  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db


def malformed() -> Job:
    job = jobs.request(reports.KIND, (reports.SUBJECT_TYPE, "not-a-permit")).job
    for _ in range(40):  # a delivery may claim another due job of the queue first
        run_delivery(job.pk, worker="w-1")
        job.refresh_from_db()
        if job.state == Job.State.FAILED:
            break
    return job


def test_malformed_payload__no_fix_no_requeue_and_the_reason(demo):  # noqa: F811
    job = malformed()
    assert (job.state, job.attempts, job.last_error_code) == ("failed", 1, "payload_invalid")
    client = login(demo, "operator")
    page = client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert 'id="fix-subject"' not in page and "Fix the subject" not in page
    assert 'id="operate-requeue"' not in page
    assert 'id="operate-none"' in page
    assert "No action can help: The job&#x27;s own parameters are malformed" in page
    assert "It stays" in page and "with this reason" in page
    confirm = client.get(f"/admin/jobs/job/{job.pk}/operate/requeue/").content.decode()
    assert "its cause is its own parameters, so a requeue would fail the same way" in confirm
    refused = client.post(f"/admin/jobs/job/{job.pk}/operate/requeue/", follow=True)
    assert "Requeue: not done" in refused.content.decode()
    job.refresh_from_db()
    assert job.state == Job.State.FAILED, "nothing requeued"


def bad_work_type(demo_client) -> tuple[Job, PermitRequest]:
    job = Job.objects.filter(kind=reports.KIND, state=Job.State.QUEUED).order_by("pk").first()
    permit = PermitRequest.objects.get(pk=job.subject_id)
    PermitRequest.objects.filter(pk=permit.pk).update(work_type="pool")
    for _ in range(40):  # a delivery may claim another due job of the queue first
        Job.objects.filter(pk=job.pk).update(next_attempt_at=job.created_at)
        run_delivery(job.pk)
        job.refresh_from_db()
        if job.state == Job.State.DEAD:
            break
    return job, permit


def test_data_error__named_in_words_with_its_field_everywhere(demo):  # noqa: F811
    job, _permit = bad_work_type(demo)
    assert job.state == Job.State.DEAD and job.last_error_code == "work_type_invalid"
    cause = causes.cause_of(job)
    assert cause is not None and cause.field == "work_type" and cause.requeue_helps
    client = login(demo, "operator")
    page = client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert "work type is not one of the valid choices" in page
    assert 'id="fix-subject"' in page and 'id="operate-requeue"' in page
    console = client.get("/admin/jobs/job/dashboard/?part=live").content.decode()
    assert "work type is not one of the valid choices" in console
    assert "KeyError" not in console


def test_data_error__the_reviewer_reads_it_without_the_raw_value_alone(demo):  # noqa: F811
    _job, permit = bad_work_type(demo)
    reviewer = login(demo, "reviewer47")
    page = reviewer.get(f"/requests/{permit.pk}/").content.decode()
    assert "pool (not a valid work type: the office has to correct it)" in page
    assert "the office has to correct the request before the report can be built" in page
    queue = reviewer.get("/").content.decode()
    assert ">pool<" not in queue


def test_unexplained_error__still_a_sentence_with_its_code():
    job = Job(kind="x.kind", last_error_class="unknown", last_error_code="KeyError")
    assert causes.plain_words(job).startswith("An error the x.kind job does not explain (KeyError)")
    assert causes.requeue_helps(job) and causes.subject_fix_helps(job)


def test_retry_now__in_a_queue_no_worker_serves_says_so_with_the_command(demo):  # noqa: F811
    waiting = jobs.request("test.short", ("auth.user", 31), queue="heavy").job
    Job.objects.filter(pk=waiting.pk).update(
        state=Job.State.RETRY_WAIT,
        attempts=1,
        next_attempt_at=Now() - timedelta(minutes=3),
        last_error_class="temporary",
        last_error_code="temporary",
    )
    client = login(demo, "operator")
    page = client.get(f"/admin/jobs/job/{waiting.pk}/change/").content.decode()
    assert 'id="warning-retry_now"' in page
    assert "No worker serves queue heavy" in page
    assert "manage.py jobs_worker --queue heavy" in page
    confirm = client.get(f"/admin/jobs/job/{waiting.pk}/operate/retry_now/").content.decode()
    assert 'id="operate-warning"' in confirm and "No worker serves queue heavy" in confirm


def test_requeue__of_a_dead_group_child_says_its_join_has_ended(demo):  # noqa: F811
    parent = jobs.request("test.short", ("auth.user", 40)).job
    join = jobs.request("test.short", ("auth.user", 41)).job
    Job.objects.filter(pk=join.pk).update(state=Job.State.FAILED, last_error_class="validation")
    group = JobGroup.objects.create(
        parent=parent,
        name="parts",
        size=1,
        ended=1,
        not_succeeded=1,
        join=join,
        join_kind="test.short",
    )
    child = jobs.request("test.short", ("auth.user", 42)).job
    Job.objects.filter(pk=child.pk).update(
        state=Job.State.DEAD,
        group=group,
        group_outcome="dead",
        last_error_class="unknown",
        last_error_code="RuntimeError",
        finished_at=timezone.now(),
    )
    client = login(demo, "operator")
    page = client.get(f"/admin/jobs/job/{child.pk}/change/").content.decode()
    assert 'id="warning-requeue"' in page
    assert f"Its group&#x27;s join (job {join.pk}) has already failed" in page


def test_wording__cancel_of_a_running_job_is_asked_not_running_to_running(demo):  # noqa: F811
    job = jobs.request("test.short", ("auth.user", 50)).job
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.RUNNING,
        lease_owner="w-1",
        lease_expires_at=timezone.now() + timedelta(minutes=5),
    )
    client = login(demo, "operator")
    client.post(f"/admin/jobs/job/{job.pk}/operate/cancel/")
    entry = LogEntry.objects.filter(object_id=str(job.pk)).latest("action_time")
    message = entry.get_change_message()
    assert "running → running" not in message
    assert message == "Cancel: asked while running"


def test_wording__one_failed_try_is_one_try():
    alone = verdict.FailingSubject("permits.permitrequest", "3", 1, 2, 9)
    reason = verdict._one_subject_reason(alone, "5 min")
    assert "failed 1 try:" in reason.text and "1 tries" not in reason.text


def test_wording__a_wait_older_than_the_chart_is_said_as_an_age(demo):  # noqa: F811
    from jobs.ops import trends

    job = Job.objects.get(pk=84)
    assert job.created_at < timezone.now() - timedelta(days=20)
    oldest = {t.key: t for t in trends.trends()}["oldest-wait"]
    assert oldest.top_text.startswith("the oldest has waited ")
    assert "longest" not in oldest.top_text
    assert Attempt.objects.count() == 0


def waiting_malformed() -> Job:
    """A malformed job waiting to run again: a script requeued it through the engine's
    service (which, unlike the console, does not ask whether a requeue can help)."""
    from jobs import services as job_services

    job = malformed()
    assert job_services.requeue_job(job, operator="script")
    job.refresh_from_db()
    return job


def test_fail_it__the_only_action_on_a_waiting_job_its_parameters_stop(demo, caplog):  # noqa: F811
    from jobs.models import JobEvent

    job = waiting_malformed()
    assert (job.state, job.last_error_code) == ("queued", "payload_invalid")
    client = login(demo, "operator")
    page = client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    offered = [
        name
        for name in ("fail", "cancel", "retry_now", "requeue")
        if f'id="operate-{name}"' in page
    ]
    assert offered == ["fail"], offered
    assert 'id="fix-subject"' not in page
    url = f"/admin/jobs/job/{job.pk}/operate/fail/"
    confirm = client.get(url).content.decode()
    assert 'name="reason"' in confirm and 'id="operate-confirm"' in confirm

    empty = client.post(url, {"reason": "   "})
    assert empty.status_code == 400 and "Say why" in empty.content.decode()
    long = client.post(url, {"reason": "x" * 301})
    assert long.status_code == 400 and "at most 300" in long.content.decode()
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED, "a refused reason changes nothing"

    reason = "Asked with a text id by an old import; the request has its own report."
    with caplog.at_level("INFO"):
        done = client.post(url, {"reason": reason})
    assert done.status_code == 302
    job.refresh_from_db()
    assert (job.state, job.attempts, job.last_error_code) == ("failed", 1, "payload_invalid")
    event = JobEvent.objects.filter(job=job).latest("id")
    assert (event.action, event.actor, event.note) == ("fail", "operator:operator", reason)
    assert (event.from_state, event.to_state) == ("queued", "failed")
    entry = LogEntry.objects.filter(object_id=str(job.pk)).latest("action_time")
    assert reason in entry.get_change_message()
    assert reason not in caplog.text, "the reason is the history's, not a log line's"
    # Never tried again: a delivery finds nothing of it to run.
    later = run_delivery(job.pk)
    assert later.job_id != job.pk or later.outcome == "duplicate", later
    assert Attempt.objects.filter(job=job, number__gt=0).count() == 1


def test_fail_it__not_offered_where_its_cause_can_still_be_fixed(demo):  # noqa: F811
    job, _ = bad_work_type(demo)
    assert job.state == Job.State.DEAD
    client = login(demo, "operator")
    page = client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert 'id="operate-requeue"' in page and 'id="operate-fail"' not in page
    refused = client.post(
        f"/admin/jobs/job/{job.pk}/operate/fail/", {"reason": "tired of it"}, follow=True
    )
    assert "Fail it: not done" in refused.content.decode()
    assert "its cause may still be fixed" in refused.content.decode()
    job.refresh_from_db()
    assert job.state == Job.State.DEAD


def test_fail_it__a_stale_read_changes_nothing(demo):  # noqa: F811
    """The arrow is a compare-and-swap on the version the operator's page read."""
    from jobs.engine import job_machine
    from jobs.models import JobEvent

    job = waiting_malformed()
    stale = Job.objects.get(pk=job.pk)
    for _ in range(40):  # a worker runs it meanwhile: failed again, version moved
        run_delivery(job.pk, worker="w-2")
        job.refresh_from_db()
        if job.state == Job.State.FAILED:
            break
    assert job.version > stale.version
    assert not job_machine.fail_by_operator(stale, actor="operator:x", reason="late")
    assert not JobEvent.objects.filter(job=job, action="fail").exists()
    with pytest.raises(ValueError):
        job_machine.fail_by_operator(Job.objects.get(pk=job.pk), actor="o", reason=" ")
