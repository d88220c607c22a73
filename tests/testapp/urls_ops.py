"""A project that opts in to /metrics under a prefix of its own."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [path("admin/", admin.site.urls), path("ops/", include("jobs.urls"))]
