"""Site URLs: the reviewer pages at the root, the admin under ``admin/``.

The engine's ``/metrics`` is included at the root; the admin dashboard comes
with the admin (``JobAdmin.get_urls``: ``admin/jobs/job/dashboard/``).
"""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from permits import views
from permits.friendly import not_found_page, server_error_page

urlpatterns = [
    path("", include("jobs.urls")),
    path("admin/", admin.site.urls),
    path(
        "accounts/login/",
        auth_views.LoginView.as_view(redirect_authenticated_user=True),
        name="login",
    ),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.queue, name="queue"),
    path("requests/<int:pk>/", views.request_detail, name="request_detail"),
    path("requests/<int:pk>/status/", views.report_status, name="report_status"),
    path("requests/<int:pk>/report/", views.report_download, name="report_download"),
    path("requests/<int:pk>/report/generate/", views.generate_report, name="generate_report"),
    path("requests/<int:pk>/revisions/", views.request_revision, name="request_revision"),
    path("requests/<int:pk>/decisions/", views.decide, name="decide"),
    path("notices/", views.notice_list, name="notice_list"),
    path("notices/<int:pk>/", views.notice_open, name="notice_open"),
    path("notices/<int:pk>/read/", views.notice_read, name="notice_read"),
    path("notices/read-all/", views.notice_read_all, name="notice_read_all"),
]

handler404 = not_found_page
handler500 = server_error_page  # the error's time and reference (permits.friendly)
