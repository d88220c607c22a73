"""The admin plus the engine's operator URLs, for tests independent of the site's pages."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [path("", include("jobs.urls")), path("admin/", admin.site.urls)]
