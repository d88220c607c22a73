"""The site's own 404 and 500 pages also when DEBUG is on (the demo runs with it on).

Django answers an unknown URL with its technical 404 page, and an error in a view with
its technical 500 page (settings, local variables, the traceback), while ``DEBUG`` is
on: not what a reviewer should meet in the demo, and the 500 page shows private values.
This middleware swaps those pages (and only those: they carry Django's robots mark, ours
never do) for ``404.html`` and ``500.html``. Django has already logged the server error
with its traceback (the ``django.request`` logger) before the swap, so a developer running
the demo finds it in the console.
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseServerError
from django.shortcuts import render
from django.template import loader
from django.urls import NoReverseMatch, reverse


def _is_technical(response) -> bool:
    """Django's technical 404/500 page (its robots tag is the mark; ours never has it)."""
    if getattr(response, "streaming", False):
        return False
    return b'content="NONE,NOARCHIVE"' in response.content[:2000]


def server_error_page() -> HttpResponseServerError:
    """``500.html`` as Django's ``server_error`` renders it: no request context, so it
    shows even when the database or a context processor is what failed."""
    return HttpResponseServerError(loader.get_template("500.html").render())


def not_found_page(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """``404.html``; under the admin's URLs its way back leads to the admin index, not to
    a reviewer's queue an operator may not have. Also the site's ``handler404``."""
    try:
        admin_index = reverse("admin:index")
    except NoReverseMatch:  # pragma: no cover - the site always mounts the admin
        admin_index = ""
    in_admin = bool(admin_index) and request.path.startswith(admin_index)
    return render(request, "404.html", {"admin_index": admin_index if in_admin else ""}, status=404)


class FriendlyNotFound:
    """Render the site's 404 and 500 pages in place of Django's technical ones under DEBUG."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if (
            settings.DEBUG
            and response.status_code in (404, 500)
            and "text/html" in response.get("Content-Type", "")
            and _is_technical(response)
        ):
            if response.status_code == 500:
                return server_error_page()
            return not_found_page(request)
        return response
