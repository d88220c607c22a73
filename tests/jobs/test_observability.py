"""Operator observability: /metrics, the dashboard, JSON logs, retention."""

from __future__ import annotations

import json
import logging
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from jobs.delivery.runner import claim_for as claim
from jobs.delivery.runner import run_delivery
from jobs.logformat import JsonFormatter
from jobs.models import Attempt, Job
from tests.jobs.helpers import new_job

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.testapp.urls")]


@pytest.fixture
def finished(make_user):
    user = make_user()
    job = new_job(user)
    run_delivery(job.pk, worker="w1")
    run_delivery(job.pk, worker="w2")
    return job


def test_metrics__refuses_anonymous_and_serves_staff(client, finished, make_user):
    assert client.get("/metrics").status_code == 403
    client.force_login(make_user(is_staff=True, is_superuser=True))
    response = client.get("/metrics")
    assert response.status_code == 200
    text = response.content.decode()
    assert 'jobs_deliveries_total{outcome="succeeded"} 1.0' in text
    assert "jobs_duplicate_deliveries_total 1.0" in text
    assert "jobs_duplicate_effects 0.0" in text
    assert 'jobs_effects{provider="inapp",state="applied"} 1.0' in text
    assert 'jobs_jobs{state="succeeded"} 1.0' in text
    assert 'jobs_provider_in_flight{provider="webhook"} 0.0' in text


def test_metrics__bearer_token(client, finished, settings):
    settings.METRICS_TOKEN = "s3cret-token"
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 403
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-token").status_code == 200


def test_metrics__no_token_configured_means_no_token_access(client, finished, settings):
    settings.METRICS_TOKEN = ""
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 403


def test_dashboard__renders_figures_and_chart_for_operators(
    client, finished, admin_user, make_user
):
    client.force_login(admin_user)
    page = client.get("/admin/jobs/job/dashboard/")
    assert page.status_code == 200
    body = page.content.decode()
    assert 'id="jobs-chart"' in body and "<polyline" in body
    assert "Duplicate effects" in body
    client.force_login(make_user(is_staff=True))  # staff without job permissions
    assert client.get("/admin/jobs/job/dashboard/").status_code == 403


def test_json_logs__one_object_per_transition_with_ids_only(make_user, caplog):
    caplog.set_level(logging.INFO, logger="jobs")
    job = new_job(make_user(), secret="do-not-log-me")
    claim(job.pk, "w1")
    record = next(r for r in caplog.records if getattr(r, "arrow", None) == "claim")
    entry = json.loads(JsonFormatter().format(record))
    assert entry["job"] == job.pk and entry["arrow"] == "claim" and entry["worker"] == "w1"
    assert entry["attempt"] == 1 and entry["logger"] == "jobs.transitions"
    assert "do-not-log-me" not in caplog.text


def test_prune__refuses_a_window_inside_redelivery_and_keeps_recent_rows(finished):
    with pytest.raises(CommandError, match="redelivery safety window"):
        call_command("jobs_prune", "--older-than", "0.5")
    call_command("jobs_prune", "--older-than", "30")
    assert Attempt.objects.count() == 2, "recent history is kept"


def test_prune__removes_old_history_but_keeps_jobs(make_user):
    user = make_user()
    job = new_job(user, recipients=[])
    run_delivery(job.pk, worker="w1")
    old = timezone.now() - timedelta(days=40)
    Job.objects.filter(pk=job.pk).update(finished_at=old)
    Attempt.objects.update(started_at=old)
    call_command("jobs_prune", "--older-than", "30")
    assert Attempt.objects.count() == 0 and Job.objects.filter(pk=job.pk).exists()
