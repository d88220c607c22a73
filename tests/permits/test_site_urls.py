"""The site wires the engine's operator URLs: /metrics and the admin dashboard."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

pytestmark = pytest.mark.django_db


def test_site__serves_metrics_and_dashboard_to_operators_only(client):
    call_command("seed_demo", stdout=open("/dev/null", "w"))  # noqa: SIM115
    assert client.get("/metrics").status_code == 403
    users = get_user_model().objects
    client.force_login(users.get(username="reviewer47"))  # staff, but not an operator
    assert client.get("/admin/jobs/job/dashboard/").status_code == 403
    assert client.get("/metrics").status_code == 403
    client.force_login(users.get(username="operator"))
    assert "jobs_jobs" in client.get("/metrics").content.decode()
    page = client.get("/admin/jobs/job/dashboard/")
    assert page.status_code == 200 and 'id="jobs-chart"' in page.content.decode()
