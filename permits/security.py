"""Request-level safety rules of the site: private pages are never stored, which
address a login attempt comes from, and the login limits.

All are wired in settings (``MIDDLEWARE``, ``AXES_CLIENT_IP_CALLABLE``, ``AXES_HANDLER``).
"""

from __future__ import annotations

from collections.abc import Callable

from axes.attempts import get_cool_off_threshold
from axes.handlers.database import AxesDatabaseHandler
from axes.helpers import get_failure_limit
from axes.models import AccessAttempt
from django.conf import settings
from django.db.models import Sum
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


class LoginLimitsHandler(AxesDatabaseHandler):
    """django-axes' database handler with a second, higher limit per address.

    axes locks a username at one address after ``LOGIN_FAILURE_LIMIT`` failures (its
    ``AXES_LOCKOUT_PARAMETERS``). Password spraying tries few passwords on many usernames
    and never reaches that; so failures from one address are also summed across usernames,
    and at ``LOGIN_ADDRESS_FAILURE_LIMIT`` every login from that address is refused (the
    lockout page says so) until the cool-off passes or someone deletes the address's rows.
    The same ``AccessAttempt`` rows are counted, so every unlock path of axes still works.
    """

    def get_failures(self, request, credentials=None) -> int:
        failures = super().get_failures(request, credentials)
        if address_failures(request) >= settings.LOGIN_ADDRESS_FAILURE_LIMIT:
            request.login_address_capped = True
            return max(failures, get_failure_limit(request, credentials))
        return failures


def address_failures(request) -> int:
    """Failed logins from the request's address, across usernames, within the cool-off."""
    attempts = AccessAttempt.objects.filter(ip_address=request.axes_ip_address)
    if settings.AXES_COOLOFF_TIME is not None:
        attempts = attempts.filter(attempt_time__gte=get_cool_off_threshold(request))
    return attempts.aggregate(n=Sum("failures_since_start"))["n"] or 0
