"""The site's plain log lines: an exception as its traceback without its messages.

A server error is logged with the traceback an operator needs (``django.request``), but an
exception's message may quote what the request carried (an applicant's phone in a
``DataError``, say): the plain format prints each exception's class and frames, and
"(message redacted)" where the message would be, as the JSON format does.
"""

from __future__ import annotations

import logging
import traceback


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return list(reversed(seen))


def redacted_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` and its causes: classes and frames, never a message."""
    parts: list[str] = []
    for i, err in enumerate(_chain(exc)):
        if i:
            parts.append("\nwhich led to:\n")
        parts.append("Traceback (most recent call last):\n")
        # Files, lines and functions only: a source line may quote a literal.
        parts.extend(
            f'  File "{frame.filename}", line {frame.lineno}, in {frame.name}\n'
            for frame in traceback.extract_tb(err.__traceback__)
        )
        parts.append(f"{type(err).__module__}.{type(err).__qualname__} (message redacted)")
    return "".join(parts)


class PlainFormatter(logging.Formatter):
    """``%(asctime)s %(levelname)s %(name)s %(message)s`` with redacted tracebacks."""

    def formatException(self, ei) -> str:
        if ei and ei[1] is not None:
            return redacted_traceback(ei[1])
        return super().formatException(ei)
