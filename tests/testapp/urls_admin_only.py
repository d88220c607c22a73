"""A project that includes nothing of the app: the admin alone."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
