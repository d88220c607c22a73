"""The site's URLs plus a view that fails: the 500 page is what a reader meets then."""

from django.urls import include, path


def boom(request):
    raise RuntimeError("private-value-in-an-error 1234")


urlpatterns = [path("boom/", boom), path("", include("permits.urls"))]

handler500 = "permits.friendly.server_error_page"  # as the site's URLs
