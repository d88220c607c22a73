"""Operator URLs; the site includes them (``path("", include("jobs.urls"))``)."""

from django.urls import path

from jobs import views

urlpatterns = [
    path("metrics", views.metrics_view, name="jobs-metrics"),
    path("admin/jobs/dashboard/", views.dashboard_view, name="jobs-dashboard"),
]
