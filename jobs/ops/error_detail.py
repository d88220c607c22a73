"""Error messages and tracebacks on operator screens, for those who hold view_error_detail.

A message or a traceback may quote the data a job worked on (an applicant's name in a
``KeyError``), so every screen that shows one asks ``can_view_error_detail`` first.
"""

from __future__ import annotations

from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString

from jobs import failures

ERROR_DETAIL_PERMISSION = "jobs.view_error_detail"


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
