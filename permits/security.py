"""Request-level safety rules of the site: private pages are never stored, and which
address a login attempt comes from.

Both are wired in settings (``MIDDLEWARE``, ``AXES_CLIENT_IP_CALLABLE``).
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.utils.cache import add_never_cache_headers


class PrivatePagesNotStored:
    """``Cache-Control: no-store`` on every response to a signed-in user.

    Every page a signed-in user gets may show private data (a request's applicant card,
    a report, notices, the admin), so no browser or shared cache may keep a copy after
    logout or revocation. One rule here instead of a decorator on each view; static
    files (whitenoise, earlier in the chain) keep their long cache lifetimes.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            add_never_cache_headers(response)
        return response


def client_ip(request: HttpRequest) -> str:
    """The address login throttling counts failures for.

    Behind the proxy (``BEHIND_PROXY=1``) every connection comes from the proxy, so the
    client is the last address the proxy appended to ``X-Forwarded-For`` (earlier entries
    are whatever the client sent and are not trusted). Otherwise, the peer address.
    """
    if settings.BEHIND_PROXY:
        forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
        last = forwarded.rsplit(",", 1)[-1].strip()
        if last:
            return last
    return request.META.get("REMOTE_ADDR", "")
