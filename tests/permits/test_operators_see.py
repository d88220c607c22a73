"""Operators see everything the engine records (issue 44): steps and groups, queue,
priority and progress on the job page and the jobs list, progress that moves on an open
page, an unserved queue flagged at once with its command, "0 workers" only when none is
alive."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, Permission
from django.db.models.functions import Now
from django.test import Client
from django.utils import timezone

import jobs
from jobs.models import Attempt, Job
from jobs.ops import console

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(make_user):
    user = make_user(username="op-see", is_staff=True)
    user.groups.add(Group.objects.get(name="operators"))
    return user


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_operators__view_steps_groups_and_history_but_change_none():
    perms = set(Group.objects.get(name="operators").permissions.values_list("codename", flat=True))
    for model in ("jobstep", "jobgroup", "jobevent"):
        assert f"view_{model}" in perms
        assert f"change_{model}" not in perms and f"delete_{model}" not in perms


def test_operators__the_job_page_shows_its_steps(operator):
    from jobs.models import JobStep

    job = jobs.request("test.short", ("auth.user", 5)).job
    JobStep.objects.create(
        job=job, name="render", attempt=1, worker="host:1", started_at=timezone.now()
    )
    page = signed_in(operator).get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert "render" in page and "Steps" in page


def heavy_job(subject: int = 9, *, priority: int = 5) -> Job:
    job = jobs.request("test.short", ("auth.user", subject), queue="heavy", priority=priority).job
    Job.objects.filter(pk=job.pk).update(
        progress_done=3,
        progress_total=4,
        progress_note="render",
        progress_at=timezone.now(),
    )
    job.refresh_from_db()
    return job


def test_job_list__queue_priority_and_progress_columns_and_filters(operator):
    job = heavy_job()
    other = jobs.request("test.short", ("auth.user", 10)).job
    client = signed_in(operator)
    page = client.get("/admin/jobs/job/").content.decode()
    for column in ("column-queue_column", "column-priority_column", "column-progress_column"):
        assert column in page
    assert "3 of 4 (75%): render" in page
    filtered = client.get("/admin/jobs/job/?queue=heavy")
    shown = [j.pk for j in filtered.context["cl"].result_list]
    assert shown == [job.pk] and other.pk not in shown
    by_priority = client.get("/admin/jobs/job/?priority=5")
    assert [j.pk for j in by_priority.context["cl"].result_list] == [job.pk]


def test_job_page__queue_priority_progress_and_the_live_line(operator):
    job = heavy_job()
    page = signed_in(operator).get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert 'class="form-row field-queue' in page or "field-queue" in page
    assert "heavy" in page and "field-priority" in page
    assert "3 of 4 (75%): render" in page
    assert 'id="jobs-live"' in page and f'data-live-url="/admin/jobs/job/{job.pk}/follow/"' in page
    assert "jobs/live.js" in page and "<script>" not in page, "no inline script (CSP)"


def test_job_page__no_live_line_once_finished(operator):
    job = heavy_job()
    Job.objects.filter(pk=job.pk).update(state=Job.State.SUCCEEDED)
    page = signed_in(operator).get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert 'id="jobs-live"' not in page


def test_follow_url__answers_the_progress_as_it_moves(operator):
    job = heavy_job()
    client = signed_in(operator)
    url = f"/admin/jobs/job/{job.pk}/follow/"
    first = json.loads(client.get(url).content)
    assert first["progress"] == "3 of 4 (75%): render" and not first["settled"]
    Job.objects.filter(pk=job.pk).update(progress_done=4, progress_note="store")
    answer = client.get(url)
    assert json.loads(answer.content)["progress"] == "4 of 4 (100%): store"
    assert "no-store" in answer["Cache-Control"]


def test_follow_url__needs_the_view_permission(make_user):
    job = heavy_job()
    staff = make_user(username="staff-only", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_effect"))
    assert signed_in(staff).get(f"/admin/jobs/job/{job.pk}/follow/").status_code == 403


def _claimed_now(job: Job) -> None:
    Attempt.objects.create(job=job, number=1, worker="host:1", started_at=timezone.now())


def test_queue__passed_by_live_workers_is_flagged_at_once_with_its_command():
    waiting = jobs.request("test.short", ("auth.user", 20), queue="heavy").job
    Job.objects.filter(pk=waiting.pk).update(next_attempt_at=Now() - timedelta(seconds=10))
    served = jobs.request("test.short", ("auth.user", 21)).job
    _claimed_now(served)  # a worker of "default" claimed after heavy's job came due
    health = console.health(console.snapshot())
    idle = {r.key: r for r in health.reasons}["queue-idle"]
    assert idle.level == "bad" and idle.command == "manage.py jobs_worker --queue heavy"
    assert "Start one with manage.py jobs_worker --queue heavy" in idle.text
    workers = {r.key: r for r in health.reasons}["workers"]
    assert workers.level == "ok" and workers.text == "1 worker seen in the last minute"


def test_queue__due_just_now_and_nobody_passed_it_by_is_not_flagged_yet():
    waiting = jobs.request("test.short", ("auth.user", 22), queue="heavy").job
    Job.objects.filter(pk=waiting.pk).update(next_attempt_at=Now() - timedelta(seconds=5))
    assert "queue-idle" not in {r.key for r in console.health(console.snapshot()).reasons}


def test_workers__zero_only_when_none_is_alive():
    waiting = jobs.request("test.short", ("auth.user", 23), queue="heavy").job
    Job.objects.filter(pk=waiting.pk).update(next_attempt_at=Now() - timedelta(seconds=5))
    snap = console.snapshot()
    idle_alive = dataclasses.replace(snap, workers=[], listening=2)
    line = {r.key: r for r in console.health(idle_alive).reasons}["workers"]
    assert line.level == "ok" and line.text.startswith("2 workers connected and waiting")
    assert "0 workers" not in line.text
    none_alive = dataclasses.replace(snap, workers=[], listening=0)
    line = {r.key: r for r in console.health(none_alive).reasons}["workers"]
    assert line.level == "bad" and "No worker is running while jobs are due" in line.text
    assert line.command == "manage.py jobs_worker"


def test_workers__listeners_counted_on_postgresql_only(settings):
    from django.db import connection

    found = console.listening_workers()
    if connection.vendor == "postgresql":
        assert found == 0, "no worker runs in this test"
    else:
        assert found is None
