"""The console's blocked sequences and their release (docs/app/sequences.md): operators
only, a POST with its CSRF token, recorded (the job's event and an admin LogEntry)."""

from __future__ import annotations

import json

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse

import jobs
from jobs.models import SEQUENCE_HELD, Job, JobEvent
from jobs.registry import kinds, register_kind
from tests.jobs.ops.test_redrive import operator

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.testapp.urls")]

KIND = "test.seq.console"
if KIND not in kinds():
    register_kind(KIND, lambda ctx: [], sequence=lambda params, subject: "permit:7")


def blocked_by_a_dead_job() -> tuple[Job, Job]:
    a = jobs.request(KIND, ("seq", "a")).job
    b = jobs.request(KIND, ("seq", "b")).job
    Job.objects.filter(pk=a.pk).update(state=Job.State.DEAD, attempts=5)
    return a, b


def test_sequences_console__lists_the_holder_and_an_operator_releases_it(client, make_user):
    a, b = blocked_by_a_dead_job()
    user = operator(make_user)
    client.force_login(user)
    page = client.get(reverse("admin:jobs_job_sequences"))
    assert page["Cache-Control"].startswith("max-age=0") or "no-store" in page["Cache-Control"]
    text = page.content.decode()
    assert "permit:7" in text and f"job {a.pk}" in text and f"job {b.pk}" in text
    assert "holds its sequence until released" in text and ">Release</button>" in text
    job_page = client.get(reverse("admin:jobs_job_change", args=[b.pk])).content.decode()
    assert "waits its turn in sequence permit:7" in job_page, "the state says why it waits"
    done = client.post(
        reverse("admin:jobs_job_sequence_release"), {"job": a.pk, "note": "bad input"}, follow=True
    )
    assert done.status_code == 200 and f"Job {a.pk} released" in done.content.decode()
    assert Job.objects.get(pk=b.pk).held_by == "", "the next job is the claim's now"
    event = JobEvent.objects.get(job=a, action="release_sequence")
    assert (event.actor, event.note) == (f"operator:{user.get_username()}", "bad input")
    entry = LogEntry.objects.get(object_id=str(a.pk))
    assert entry.user_id == user.pk
    record = json.loads(entry.change_message)["release_sequence"]
    assert (record["key"], record["state"], record["job"]) == ("permit:7", "dead", a.pk)
    assert (
        "No sequence is blocked" in client.get(reverse("admin:jobs_job_sequences")).content.decode()
    )


def test_sequences_console__a_non_operator_sees_the_list_and_cannot_release(client, make_user):
    a, b = blocked_by_a_dead_job()
    client.force_login(operator(make_user, perms=("view_job", "view_effect")))
    page = client.get(reverse("admin:jobs_job_sequences"))
    assert page.status_code == 200 and ">Release</button>" not in page.content.decode()
    assert client.post(reverse("admin:jobs_job_sequence_release"), {"job": a.pk}).status_code == 403
    assert client.get(reverse("admin:jobs_job_sequence_release")).status_code == 405
    assert Job.objects.get(pk=b.pk).held_by == SEQUENCE_HELD
    assert not LogEntry.objects.exists() and not JobEvent.objects.filter(job=a).exists()


def test_sequences_console__a_post_without_the_csrf_token_is_refused(make_user):
    a, b = blocked_by_a_dead_job()
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator(make_user))
    assert client.post(reverse("admin:jobs_job_sequence_release"), {"job": a.pk}).status_code == 403
    assert Job.objects.get(pk=b.pk).held_by == SEQUENCE_HELD


def test_sequences_console__no_view_permission_no_list(client, make_user):
    client.force_login(operator(make_user, perms=()))
    assert client.get(reverse("admin:jobs_job_sequences")).status_code == 403
