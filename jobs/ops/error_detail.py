"""Error messages and tracebacks on operator screens, for those who hold view_error_detail.

A message or a traceback may quote the data a job worked on (an applicant's name in a
``KeyError``), so every screen that shows one asks ``can_view_error_detail`` first.
"""

from __future__ import annotations

from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString

from jobs import failures, registry
from jobs.exceptions import JobError

ERROR_DETAIL_PERMISSION = "jobs.view_error_detail"


def kind_redacts(kind: str) -> bool:
    """Whether ``kind`` declared ``redact_errors`` (True or a predicate): its error texts
    may carry private values, so no screen shows a job's stored detail, whoever reads.

    The stored detail of such a kind is empty once the runner classifies with the kind's
    ``redact`` (``jobs.retry.classify``); rows written before are still hidden here."""
    try:
        return bool(registry.get_kind(kind).redact_errors)
    except JobError:  # no such kind (any more): nothing says its texts are safe
        return True


def shown_detail(kind: str, detail: str, *, allowed: bool) -> str:
    """A job's or attempt's stored detail as a screen may show it: "" unless the reader
    holds ``jobs.view_error_detail`` and the kind does not redact."""
    if not detail or not allowed or kind_redacts(kind):
        return ""
    return detail


def can_view_error_detail(request: HttpRequest) -> bool:
    """Messages and tracebacks may quote data: shown only with ``jobs.view_error_detail``."""
    return request.user.has_perm(ERROR_DETAIL_PERMISSION)


def error_block(type_path: str, message: str, traceback: str) -> SafeString | str:
    """``KeyError: 'pool'`` above its traceback (a collapsed block when there is one)."""
    if not type_path:
        return "—"
    head = failures.headline(type_path, message)
    if not traceback:
        return format_html('<code class="jobs-error">{}</code>', head)
    return format_html(
        '<details class="jobs-error"><summary><code>{}</code></summary>'
        '<pre class="jobs-traceback">{}</pre></details>',
        head,
        traceback,
    )
