"""No private applicant field in a log line, an error field, a notice or a queue row."""

from __future__ import annotations

import logging

import pytest
from django.core import serializers
from django_q.models import OrmQ, Task

from jobs.delivery.runner import run_delivery
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
