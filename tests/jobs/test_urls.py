"""The dashboard comes with the admin (``JobAdmin.get_urls``); ``/metrics`` is opt-in."""

from __future__ import annotations

import sys

import pytest
from django.urls import Resolver404, resolve, reverse

pytestmark = pytest.mark.django_db


@pytest.mark.urls("tests.testapp.urls_admin_only")
def test_dashboard__served_by_the_admin_without_an_include(client, admin_user):
    client.force_login(admin_user)
    url = reverse("admin:jobs_job_dashboard")
    assert url == "/admin/jobs/job/dashboard/"
    page = client.get(url)
    assert page.status_code == 200 and 'id="jobs-chart"' in page.content.decode()
    assert "Prometheus metrics" not in page.content.decode()  # not included: no link
    listing = client.get("/admin/jobs/job/").content.decode()
    assert f'href="{url}"' in listing  # the Dashboard button on the jobs list
    with pytest.raises(Resolver404):
        resolve("/metrics")


@pytest.mark.urls("tests.testapp.urls_ops")
def test_metrics__under_the_prefix_the_project_chose(client, admin_user):
    client.force_login(admin_user)
    assert reverse("jobs-metrics") == "/ops/metrics"
    assert "jobs_jobs" in client.get("/ops/metrics").content.decode()
    page = client.get(reverse("admin:jobs_job_dashboard")).content.decode()
    assert 'href="/ops/metrics"' in page


@pytest.mark.urls("tests.testapp.urls_ops")
def test_metrics__without_the_extra_a_plain_404_that_names_it(client, admin_user, monkeypatch):
    # No prometheus_client installed: an import of it fails as it would in such a project.
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    client.force_login(admin_user)
    response = client.get("/ops/metrics")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/plain")
    assert "pip install 'django-jobs-ledger[metrics]'" in response.content.decode()


@pytest.mark.urls("tests.testapp.urls_ops")
def test_metrics__without_the_extra_still_refuses_anonymous(client, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    assert client.get("/ops/metrics").status_code == 403
