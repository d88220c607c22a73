"""Opt-in operator URLs under a prefix the project chooses: ``path("ops/", include("jobs.urls"))``.

Only ``metrics`` (Prometheus, needs ``django-jobs-ledger[metrics]``). The admin
dashboard needs no include: ``JobAdmin.get_urls`` serves it at
``<admin>/jobs/job/dashboard/``.
"""

from django.urls import path

from jobs import views

urlpatterns = [
    path("metrics", views.metrics_view, name="jobs-metrics"),
]
