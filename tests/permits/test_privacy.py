"""No private applicant field in a log line, an error field, a notice or a queue row."""

from __future__ import annotations

import html
import logging

import pytest
from django.core import serializers
from django_q.models import OrmQ, Task

from jobs.delivery.runner import run_delivery
from jobs.exceptions import PayloadInvalid
from jobs.models import Attempt, Effect, Job, Notice
from permits import reports
from permits.models import PermitRequest
from permits.services import report_request, revoke_reviewer
from tests.jobs.helpers import request_job
from tests.permits import factories

pytestmark = pytest.mark.django_db


def test_private_fields__never_leave_the_report(make_user, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    reviewer = make_user()
    ok = factories.permit(reviewer=reviewer)
    withdrawn = factories.permit(reviewer=reviewer, status=PermitRequest.Status.WITHDRAWN)
    revoked = factories.permit(reviewer=reviewer)
    crashing = factories.permit(reviewer=reviewer)

    jobs = [report_request(p)[0] for p in (ok, withdrawn, revoked, crashing)]
    malformed, _ = request_job(
        reports.KIND, subject_type=reports.SUBJECT_TYPE, subject_id="not-a-number"
    )
    run_delivery(jobs[0].pk)
    run_delivery(jobs[1].pk)
    run_delivery(
        jobs[2].pk,
        on_stage=lambda stage, ctx: (
            stage == "before_publish" and revoke_reviewer(revoked, reviewer)
        ),
    )
    real_render = reports.render_report

    def render_that_blurts(permit, job):
        if permit.pk == crashing.pk:  # a library error quoting the data it choked on
            raise ValueError(f"cannot lay out {permit.applicant_name} {permit.applicant_phone}")
        return real_render(permit, job)

    monkeypatch.setattr(reports, "render_report", render_that_blurts)
    run_delivery(jobs[3].pk)
    run_delivery(malformed.pk)

    states = dict(Job.objects.values_list("subject_id", "state"))
    assert states[str(ok.pk)] == "succeeded" and states[str(withdrawn.pk)] == "failed"
    assert states[str(crashing.pk)] == "retry_wait" and states["not-a-number"] == "failed"
    assert Effect.objects.filter(state="withheld").count() == 1

    stored = [
        caplog.text,
        serializers.serialize("json", Job.objects.all()),
        serializers.serialize("json", Attempt.objects.all()),
        serializers.serialize("json", Effect.objects.all()),
        serializers.serialize("json", Notice.objects.all()),
        serializers.serialize("json", Task.objects.all()),
        repr([m.task for m in OrmQ.objects.all()]),
    ]
    for value in factories.PRIVATE.values():
        for where, text in zip(
            ["logs", "jobs", "attempts", "effects", "notices", "tasks", "queue"],
            stored,
            strict=True,
        ):
            assert value not in text, f"{value!r} leaked into {where}"
    assert "ValueError" in Job.objects.get(subject_id=str(crashing.pk)).last_error_code


def _quoting_payload_invalid(monkeypatch, permit) -> None:
    """The report's handler raises the engine's own PayloadInvalid with contact values in its
    text, as a careless check would (``PayloadInvalid(f"no phone {phone}")``)."""
    real_render = reports.render_report

    def render_that_quotes(p, job):
        if p.pk == permit.pk:
            raise PayloadInvalid(
                f"cannot reach {p.applicant_name} at {p.applicant_phone} / {p.applicant_email}"
            )
        return real_render(p, job)

    monkeypatch.setattr(reports, "render_report", render_that_quotes)


def _operator(make_user):
    from django.contrib.auth.models import Group

    user = make_user(is_staff=True)
    user.groups.add(Group.objects.get(name="operators"))  # holds jobs.view_error_detail
    assert user.has_perm("jobs.view_error_detail")
    assert not user.has_perm("permits.view_applicant_contact")
    return user


def _leaks(text: str) -> list[str]:
    return [v for v in factories.PRIVATE.values() if v in html.unescape(text)]


def test_payload_invalid_quoting_contacts__on_no_operator_page(make_user, client, monkeypatch):
    """Issue 32, item 5: every page an operator can reach for that job, its attempts and the
    confirmations of its operations, grepped for each contact value."""
    permit = factories.permit(reviewer=make_user())
    _quoting_payload_invalid(monkeypatch, permit)
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "failed"
    job.refresh_from_db()
    assert (job.last_error_class, job.last_error_code) == ("validation", "payload_invalid")
    attempt = Attempt.objects.get(job=job, number__gt=0)

    client.force_login(_operator(make_user))
    pages = {
        "console": "/admin/jobs/job/dashboard/",
        "jobs list": "/admin/jobs/job/",
        "failed jobs": "/admin/jobs/job/?state__exact=failed",
        "job page": f"/admin/jobs/job/{job.pk}/change/",
        "job follow": f"/admin/jobs/job/{job.pk}/follow/",
        "requeue confirmation": f"/admin/jobs/job/{job.pk}/operate/requeue/",
        "attempts list": "/admin/jobs/attempt/",
        "attempt page": f"/admin/jobs/attempt/{attempt.pk}/change/",
        "effects list": "/admin/jobs/effect/",
        "queue": "/admin/django_q/ormq/",
    }
    seen = {}
    for name, url in pages.items():
        page = client.get(url)
        assert page.status_code == 200, (name, page.status_code)
        seen[name] = page.content.decode()
    bulk = client.post(
        "/admin/jobs/job/?state__exact=failed",
        {"action": "requeue", "_selected_action": [job.pk]},
    )
    assert bulk.status_code == 200 and "Requeue" in bulk.content.decode()
    seen["bulk requeue confirmation"] = bulk.content.decode()
    assert "payload_invalid" in seen["job page"], "the page shows the error (the grep has text)"
    for name, text in seen.items():
        assert not _leaks(text), f"{_leaks(text)} on the {name}"


def test_payload_invalid_quoting_contacts__in_no_log_line_or_error_column(
    make_user, caplog, monkeypatch
):
    caplog.set_level(logging.DEBUG)
    permit = factories.permit(reviewer=make_user())
    _quoting_payload_invalid(monkeypatch, permit)
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "failed"
    attempts = serializers.serialize("json", Attempt.objects.all())
    assert "payload_invalid" in attempts
    assert not _leaks(caplog.text), "logs"
    assert not _leaks(attempts), "attempts"
    assert not _leaks(serializers.serialize("json", Effect.objects.all())), "effects"
    assert not _leaks(serializers.serialize("json", Notice.objects.all())), "notices"


def test_payload_invalid_quoting_contacts__not_in_the_job_row(make_user, monkeypatch):
    permit = factories.permit(reviewer=make_user())
    _quoting_payload_invalid(monkeypatch, permit)
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "failed"
    row = serializers.serialize("json", Job.objects.filter(pk=job.pk))
    assert "payload_invalid" in row
    assert not _leaks(row), "the job's error columns"
