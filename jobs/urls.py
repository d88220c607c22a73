"""Opt-in operator URLs under a prefix the project chooses: ``path("ops/", include("jobs.urls"))``.

Only ``metrics`` (Prometheus, needs ``django-jobs-ledger[metrics]``; without it the page
answers 404 naming the extra). The admin dashboard needs no include:
``JobAdmin.get_urls`` serves it at ``<admin>/jobs/job/dashboard/``. The URLconf stays
at ``jobs.urls`` so projects' includes keep working; its views are ``jobs.ops.views``.
"""

from django.urls import path

from jobs.ops import views

urlpatterns = [
    path("metrics", views.metrics_view, name="jobs-metrics"),
]
