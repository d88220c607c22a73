"""The trace of one permit report with a retry (issue 43): no private value in any span."""

from __future__ import annotations

import pytest

from jobs.models import Effect, Job
from permits import reports
from permits.services import report_request
from tests.jobs.helpers import deliver, make_due
from tests.jobs.telemetry_sdk import all_text, otel  # noqa: F401 (a fixture)
from tests.permits import factories

pytestmark = pytest.mark.django_db


def test_report_trace__a_retry_then_the_report_and_its_notice_with_nothing_private(
    otel,  # noqa: F811
    make_user,
    monkeypatch,
):
    reviewer = make_user()
    permit = factories.permit(reviewer=reviewer)
    real_render = reports.render_report
    calls = []

    def render_once_failing(permit, job):
        calls.append(job.attempts)
        if len(calls) == 1:  # a library error quoting the data it choked on
            raise ValueError(f"cannot lay out {permit.applicant_name} {permit.applicant_phone}")
        return real_render(permit, job)

    monkeypatch.setattr(reports, "render_report", render_once_failing)
    job, _ = report_request(permit)
    deliver(job.pk, worker="w1")
    job.refresh_from_db()
    assert job.state == Job.State.RETRY_WAIT
    make_due(job)
    deliver(job.pk, worker="w2")
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED

    (request,) = otel.spans("jobs.request")
    first, second = otel.spans("jobs.attempt")
    assert request.attributes["jobs.kind"] == reports.KIND
    assert {s.context.trace_id for s in otel.spans()} == {request.context.trace_id}
    assert second.links[0].context.span_id == first.context.span_id
    assert (first.attributes["jobs.outcome"], second.attributes["jobs.outcome"]) == (
        "retry",
        "succeeded",
    )
    steps = [(s.attributes["jobs.step.name"], s.parent.span_id) for s in otel.spans("jobs.step")]
    assert ("gather", first.context.span_id) in steps and (
        "gather",
        second.context.span_id,
    ) in steps
    assert ("render", second.context.span_id) in steps
    (publish,) = otel.spans("jobs.publish")
    effects = list(Effect.objects.filter(job=job))
    # The reviewer's in-app notice is applied in the publish's transaction (no release).
    assert publish.attributes["jobs.effects"] == len(effects) >= 1
    assert publish.attributes["jobs.effects.applied_with_publish"] == len(effects)
    keys = [e.idempotency_key for e in effects]
    private = list(factories.PRIVATE.values())
    for span in otel.spans():
        for value in all_text(span):
            for secret in [*private, *keys]:
                assert secret not in value, f"{secret!r} in span {span.name}"
