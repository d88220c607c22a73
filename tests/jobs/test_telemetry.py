"""OpenTelemetry (issue 43): one job's trace end to end, and the app without the API.

The SDK's in-memory exporter and metric reader are handed to the engine
(``jobs.telemetry.configure``), so no other test in the process sees them.
"""

from __future__ import annotations

import hashlib
import sys

import pytest

from jobs import telemetry
from jobs.exceptions import TemporaryFailure
from jobs.models import Effect, Job
from jobs.registry import EffectSpec, register_kind
from tests.jobs.helpers import deliver, make_due, new_job
from tests.jobs.telemetry_sdk import all_text, otel  # noqa: F401 (a fixture)
from tests.providers.conftest import provider, webhook  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db

KIND = "test.traced"
SECRET = "Applicant Jane Roe, ID 880412-5521"  # stands for private data: in no span


def traced(ctx) -> list[EffectSpec]:
    """One durable step, a failure on the first attempt (after the step), an artifact whose
    bytes and an effect whose data quote private data."""
    rendered = ctx.step("render", lambda: {"pages": 2, "body": SECRET})
    if ctx.job.attempts == 1:
        raise TemporaryFailure(f"renderer busy while drawing {SECRET}", code="busy")
    ctx.store_artifact(f"{rendered['body']}\n".encode(), content_type="text/plain", extension="txt")
    recipient = str(ctx.params["recipients"][0])
    return [
        EffectSpec("completion-notice", "webhook", recipient, {"title": SECRET}),
        EffectSpec("in-app-notice", "inapp", recipient, {"title": SECRET}),
    ]


register_kind(KIND, traced)


def _by_id(spans) -> dict[int, object]:
    return {s.context.span_id: s for s in spans}


def test_telemetry__one_job_with_a_retry_is_one_trace(otel, webhook, make_user):  # noqa: F811
    user = make_user()
    job = new_job(user, kind=KIND)
    assert job.trace_context, "the request's span context is stored on the row"
    deliver(job.pk, worker="w1")  # attempt 1: the step runs, then a temporary failure
    job.refresh_from_db()
    assert job.state == Job.State.RETRY_WAIT
    make_due(job)
    deliver(job.pk, worker="w2")  # attempt 2: the step is reused, publish, releases
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED

    (request,) = otel.spans("jobs.request")
    first, second = otel.spans("jobs.attempt")
    trace_id = request.context.trace_id
    assert {s.context.trace_id for s in otel.spans()} == {trace_id}, "one trace"
    assert request.attributes["jobs.job.id"] == job.pk
    assert request.attributes["jobs.job.uid"] == str(job.uid)
    assert first.parent.span_id == second.parent.span_id == request.context.span_id
    assert not first.links
    (link,) = second.links
    assert link.context.span_id == first.context.span_id, "linked to the previous attempt"
    assert (first.attributes["jobs.outcome"], second.attributes["jobs.outcome"]) == (
        "retry",
        "succeeded",
    )
    assert [first.attributes["jobs.attempt.number"], second.attributes["jobs.attempt.number"]] == [
        1,
        2,
    ]

    steps = otel.spans("jobs.step")
    assert [s.parent.span_id for s in steps] == [first.context.span_id, second.context.span_id]
    assert all(s.attributes["jobs.step.name"] == "render" for s in steps)
    events = [e.name for e in steps[1].events]
    assert "jobs.stage.step_reused" in events, "the second attempt reused the step"
    (publish,) = otel.spans("jobs.publish")
    assert publish.parent.span_id == second.context.span_id
    assert publish.attributes["jobs.effects"] == 2

    webhook_effect = Effect.objects.get(job=job, provider="webhook")
    releases = [s for s in otel.spans("jobs.release") if s.attributes["jobs.provider"] == "webhook"]
    (release,) = releases
    assert release.parent.span_id == request.context.span_id
    assert release.attributes["jobs.outcome_class"] == "applied"
    digest = hashlib.sha256(webhook_effect.idempotency_key.encode()).hexdigest()
    assert release.attributes["jobs.effect.key_sha256"] == digest[:16]

    keys = list(Effect.objects.filter(job=job).values_list("idempotency_key", flat=True))
    for span in otel.spans():
        for value in all_text(span):
            assert SECRET not in value and "Jane Roe" not in value, f"private data in {span.name}"
            for key in keys:
                assert key not in value, f"an idempotency key in {span.name}"

    deliveries = otel.counts("jobs.deliveries")
    labels = {"kind": KIND, "tenant": job.tenant_key}
    assert deliveries[tuple(sorted({**labels, "outcome": "retry"}.items()))] == 1
    assert deliveries[tuple(sorted({**labels, "outcome": "succeeded"}.items()))] == 1
    applied = otel.counts("jobs.effects_applied")
    assert applied[tuple(sorted({**labels, "provider": "webhook"}.items()))] == 1


def test_telemetry__a_fenced_out_attempt_is_counted_stale(otel, make_user):  # noqa: F811
    from jobs.engine import job_machine
    from tests.jobs.helpers import expire_lease

    job = new_job(make_user())

    def lose(stage, ctx):
        if stage == "before_publish":
            expire_lease(ctx.job)
            other = job_machine.worker_identity()
            from jobs.delivery.runner import claim_for

            assert claim_for(job.pk, other + "-b").won

    deliver(job.pk, worker="w1", on_stage=lose)
    (attempt, *_) = otel.spans("jobs.attempt")
    assert attempt.attributes["jobs.outcome"] == "lease_lost"
    assert attempt.attributes["jobs.fenced_out"] is True
    stale = otel.counts("jobs.stale_attempts")
    assert sum(stale.values()) == 1


def test_telemetry__off_without_a_provider_records_nothing(make_user):
    telemetry.configure()
    assert telemetry.active() is False
    job = new_job(make_user())
    assert job.trace_context == ""
    deliver(job.pk, worker="w1")
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED and job.trace_context == ""


WITHOUT_OTEL = """
import os, sys
sys.modules["opentelemetry"] = None  # the [otel] extra not installed: ImportError
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
import django
django.setup()
from django.db import connection
connection.creation.create_test_db(verbosity=0)
import jobs
from jobs import telemetry
from jobs.delivery import release, runner, steps
assert telemetry.AVAILABLE is False and telemetry.active() is False
for fn in (runner.run_claim, runner._publish, steps.run, release.send_claimed, jobs.request):
    assert not hasattr(fn, "__wrapped__"), fn
handle = jobs.request("test.steps", ("auth.user", 1), params={"recipients": []})
result = runner.run_delivery(handle.id, worker="w1")
print("outcome", result.outcome, "trace_context", repr(handle.refresh().job.trace_context))
"""


def test_telemetry__the_app_imports_and_runs_without_opentelemetry():
    """The [otel] extra not installed: the decorators leave the functions unwrapped and a
    job runs (a child process on SQLite: this one has the API imported)."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "TEST_DATABASE_NAME")}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "outcome succeeded trace_context ''" in done.stdout


def test_telemetry__hooks_resolve_once_to_a_cached_boolean(monkeypatch):
    calls = []
    monkeypatch.setattr(telemetry, "_resolve", lambda: calls.append(1) or False)
    monkeypatch.setattr(telemetry, "_active", None)
    assert [telemetry.active() for _ in range(3)] == [False] * 3
    assert calls == [1]


@pytest.mark.urls("tests.testapp.urls")
def test_metrics__figures_per_kind_provider_and_tenant(client, make_user):
    user = make_user()
    job = new_job(user, tenant="t9")
    deliver(job.pk, worker="w1")
    deliver(job.pk, worker="w2")  # a duplicate delivery: recorded, nothing else
    client.force_login(make_user(is_staff=True, is_superuser=True))
    text = client.get("/metrics").content.decode()
    # Prometheus' text sorts the labels by name.
    kind, tenant = 'kind="test.steps"', 'tenant="t9"'
    assert f'jobs_kind_deliveries_total{{{kind},outcome="succeeded",{tenant}}} 1.0' in text
    assert f"jobs_kind_duplicate_deliveries_total{{{kind},{tenant}}} 1.0" in text
    assert f'jobs_effects_applied_total{{{kind},provider="inapp",{tenant}}} 1.0' in text
    assert 'jobs_provider_duplicate_effects{provider="inapp"} 0.0' in text
    assert "# TYPE jobs_stale_attempts_total counter" in text
    assert "# TYPE jobs_releases_withheld_total counter" in text
    assert "# TYPE jobs_effects_suppressed_total counter" in text


def test_telemetry__gauges_read_circuits_and_duplicate_effects_from_the_tables(otel, make_user):  # noqa: F811
    from jobs.models import FlowRule

    deliver(new_job(make_user()).pk)
    FlowRule.objects.create(scope="provider:webhook", circuit_state="open")
    assert telemetry.register_gauges()
    circuit = otel.counts("jobs.provider_circuit")
    assert circuit[(("provider", "webhook"), ("state", "open"))] == 1
    assert circuit[(("provider", "webhook"), ("state", "closed"))] == 0
    assert otel.counts("jobs.duplicate_effects") == {(("provider", "inapp"),): 0}


def test_telemetry__a_redrive_is_counted(otel, make_user):  # noqa: F811
    from jobs.ops import redrive
    from tests.jobs.ops.test_redrive import inapp_effects, stuck

    stuck(inapp_effects(make_user, 2))
    group = redrive.Filter("effect", "test.steps", "needs_review", "transport", "inapp")
    redrive.redrive(group, operator="op", user_id=make_user().pk)
    counted = otel.counts("jobs.redriven")
    assert counted == {(("outcome", "redriven"), ("target", "effect")): 2}


def test_telemetry__a_release_found_by_lookup_is_a_suppressed_send(otel, webhook, make_user):  # noqa: F811
    from datetime import timedelta

    from django.utils import timezone

    from jobs.tasks import release_effect
    from tests.providers.conftest import notify_job

    webhook.faults.stall = 1.0  # applied, never answered: the ledger says unknown
    job = notify_job(make_user())
    deliver(job.pk, worker="w1")
    webhook.faults.stall = 0.0
    effect = Effect.objects.get(job=job)
    assert effect.state == Effect.State.UNKNOWN
    Effect.objects.filter(pk=effect.pk).update(
        next_attempt_at=timezone.now() - timedelta(seconds=1)
    )

    assert release_effect(effect.pk) == Effect.State.APPLIED
    release = otel.spans("jobs.release")[-1]
    (lookup,) = otel.spans("jobs.lookup")
    assert lookup.parent.span_id == release.context.span_id
    assert lookup.attributes["jobs.lookup.found"] is True
    assert release.attributes["jobs.outcome_class"] == "found"
    suppressed = otel.counts("jobs.effects_suppressed")
    labels = {"provider": "webhook", "kind": job.kind, "tenant": job.tenant_key, "by": "lookup"}
    assert suppressed == {tuple(sorted(labels.items())): 1}


def test_telemetry__a_duplicate_delivery_is_counted_apart(otel, make_user):  # noqa: F811
    job = new_job(make_user(), tenant="t3")
    deliver(job.pk, worker="w1")
    deliver(job.pk, worker="w2")  # the job is finished: recorded, nothing else
    labels = (("kind", "test.steps"), ("tenant", "t3"))
    assert otel.counts("jobs.duplicate_deliveries") == {labels: 1}
    assert len(otel.spans("jobs.attempt")) == 1, "a duplicate delivery is no attempt"
