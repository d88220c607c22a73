"""The site's own 404 and 500 pages also when DEBUG is on (the demo runs with it on).

Django answers an unknown URL with its technical 404 page, and an error in a view with
its technical 500 page (settings, local variables, the traceback), while ``DEBUG`` is
on: not what a reviewer should meet in the demo, and the 500 page shows private values.
This middleware swaps those pages (and only those: they carry Django's robots mark, ours
never do) for ``404.html`` and ``500.html``. Django has already logged the server error
with its traceback (the ``django.request`` logger) before the swap, so a developer running
the demo finds it in the console.

Every server error gets a reference and a time (``stamp_server_error``, on Django's
``got_request_exception``, before the page and the log line are made): the 500 page shows
both, and the log line ends with ``ref=<reference>`` (``ErrorReference``, a filter on the
``django.request`` logger), so an operator told "12:41:07 UTC, reference 5f3a9c2e" finds
the traceback with one search. The reference is random: it names no user, request or value.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings
from django.core.signals import got_request_exception
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse, HttpResponseServerError
from django.shortcuts import render
from django.template import loader
from django.urls import NoReverseMatch, reverse


@dataclass(frozen=True)
class ServerError:
    """What a person can quote to find one server error in the web process's log."""

    reference: str
    at: datetime

    @property
    def at_text(self) -> str:
        return self.at.strftime("%Y-%m-%d %H:%M:%S UTC")

    @property
    def at_iso(self) -> str:
        return self.at.isoformat()


def server_error_of(request: HttpRequest | None) -> ServerError:
    """The request's server error, stamped once (a fresh one where no request is known)."""
    found = getattr(request, "server_error", None)
    if found is None:
        found = ServerError(secrets.token_hex(4), datetime.now(UTC).replace(microsecond=0))
        if request is not None:
            request.server_error = found  # type: ignore[attr-defined]
    return found


@receiver(got_request_exception, dispatch_uid="permits.friendly.stamp_server_error")
def stamp_server_error(sender, request: HttpRequest | None = None, **kwargs) -> None:
    """Give the error its reference before the 500 page and the log line are made."""
    if request is not None:
        server_error_of(request)


class ErrorReference(logging.Filter):
    """Ends a ``django.request`` line about a server error with its ``ref=``, as the page
    shows it (Django passes the request to the log record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        found = getattr(getattr(record, "request", None), "server_error", None)
        if found is not None and not getattr(record, "error_reference", None):
            record.error_reference = found.reference
            record.msg = f"{record.msg} ref={found.reference}"
        return True


def _is_technical(response) -> bool:
    """Django's technical 404/500 page (its robots tag is the mark; ours never has it)."""
    if getattr(response, "streaming", False):
        return False
    return b'content="NONE,NOARCHIVE"' in response.content[:2000]


def server_error_page(request: HttpRequest | None = None) -> HttpResponseServerError:
    """``500.html`` with the error's time and reference only: no request context, so it
    shows even when the database or a context processor is what failed. Also the site's
    ``handler500``."""
    found = server_error_of(request)
    context = {
        "error_reference": found.reference,
        "error_at": found.at_text,
        "error_at_iso": found.at_iso,
    }
    return HttpResponseServerError(loader.get_template("500.html").render(context))


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
                return server_error_page(request)
            return not_found_page(request)
        return response
