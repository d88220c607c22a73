"""What a failed attempt keeps, readably and safely: class, bounded message, traceback.

Operators read the message and the traceback in the admin (behind
``jobs.view_error_detail``); logs get only the class and the traceback's frames
(file, line, function), never the message: messages may quote private data.
A kind declared with ``redact_errors`` keeps no message at all, anywhere.

Pure functions over the exception object: no database, no logging.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MESSAGE_LIMIT = 2_000  # characters of str(exc)
TRACEBACK_LIMIT = 16 * 1024  # characters of the formatted traceback
_HEAD = 2_000  # a cut traceback keeps its start and, mostly, its innermost frames

Redact = bool | Callable[[BaseException], bool]


@dataclass(frozen=True)
class ErrorDetail:
    """One failure as stored: ``type_path`` (``builtins.KeyError``), message, traceback."""

    type_path: str
    message: str
    traceback: str
    redacted: bool = False

    @property
    def type_name(self) -> str:
        """The class as Python prints it: ``KeyError``, ``myapp.errors.PoolEmpty``."""
        module, _, name = self.type_path.rpartition(".")
        return name if module == "builtins" else self.type_path

    @property
    def headline(self) -> str:
        """``KeyError: 'pool'`` (the class alone when redacted or empty)."""
        return headline(self.type_path, self.message)

    def attempt_fields(self) -> dict[str, str]:
        """The ``Attempt`` columns that keep this failure."""
        return {
            "error_type": self.type_path,
            "error_message": self.message,
            "error_traceback": self.traceback,
        }

    def job_fields(self) -> dict[str, str]:
        """The ``Job`` columns that keep its last failure."""
        return {
            "last_error_type": self.type_path,
            "last_error_message": self.message,
            "last_error_traceback": self.traceback,
        }


def headline(type_path: str, message: str) -> str:
    """``KeyError: 'pool'`` from a stored class path and message, as Python prints it."""
    module, _, name = type_path.rpartition(".")
    shown = name if module == "builtins" else type_path
    return f"{shown}: {message}" if message else shown


def original(exc: BaseException) -> BaseException:
    """The exception a wrapper stands for (``jobs.backends.TaskFailed`` keeps the task's)."""
    inner = getattr(exc, "original", None)
    return inner if isinstance(inner, BaseException) else exc


def type_path(exc: BaseException) -> str:
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def should_redact(exc: BaseException, redact: Redact) -> bool:
    """Whether ``redact`` (a kind's ``redact_errors``) hides this exception's message."""
    if callable(redact):
        try:
            return bool(redact(exc))
        except Exception:  # a broken predicate must not leak: redact
            return True
    return bool(redact)


def capture(exc: BaseException, *, redact: Redact = False) -> ErrorDetail:
    """The stored form of ``exc`` (its original, if it wraps one), bounded, no locals."""
    exc = original(exc)
    hidden = should_redact(exc, redact)
    message = "" if hidden else bound(_safe_str(exc), MESSAGE_LIMIT)
    text = _frames_only(exc) if hidden else _formatted(exc)
    return ErrorDetail(type_path(exc), message, bound(text, TRACEBACK_LIMIT, head=_HEAD), hidden)


def bound(text: str, limit: int, *, head: int | None = None) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    if head is None:
        marker = f" … [{len(text) - limit} more characters cut]"
        return text[: max(0, limit - len(marker))] + marker
    marker = f"\n  … [{len(text) - limit} characters cut] …\n"
    tail = limit - head - len(marker)
    return text[:head] + marker + text[-tail:]


def frames(exc: BaseException, *, limit: int = 12) -> list[tuple[str, int, str]]:
    """(file, line, function) of the traceback, innermost last, at most ``limit`` of them."""
    found = [
        (_short_path(f.filename), f.lineno or 0, f.name)
        for f in traceback.extract_tb(original(exc).__traceback__)
    ]
    return found[-limit:]


def frames_text(exc: BaseException) -> str:
    """``runner.py:101:run_delivery > kinds.py:12:handler``: for a log line, no message."""
    return " > ".join(f"{path}:{line}:{name}" for path, line, name in frames(exc)) or "-"


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not turn one failure into two
        return f"<{type(exc).__name__} with an unprintable message>"


def _formatted(exc: BaseException) -> str:
    try:
        found = traceback.TracebackException.from_exception(exc)
        _bound_messages(found, set())
        return "".join(found.format())
    except Exception:  # pragma: no cover - formatting an odd exception failed
        return _frames_only(exc)


def _bound_messages(te: traceback.TracebackException | None, seen: set[int]) -> None:
    """Each message in the chain at most MESSAGE_LIMIT, as the stored message is."""
    if te is None or id(te) in seen:
        return
    seen.add(id(te))
    text = getattr(te, "_str", None)  # the message TracebackException prints
    if isinstance(text, str):
        te._str = bound(text, MESSAGE_LIMIT)
    _bound_messages(te.__cause__, seen)
    _bound_messages(te.__context__, seen)


def _chain(exc: BaseException) -> list[tuple[BaseException, str]]:
    """The exceptions Python would print, outermost last, with the line joining each."""
    found: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    joint = ""
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found.append((exc, joint))
        if exc.__cause__ is not None:
            joint, exc = (
                "The above exception was the direct cause of the following exception:",
                (exc.__cause__),
            )
        elif exc.__context__ is not None and not exc.__suppress_context__:
            joint, exc = (
                "During handling of the above exception, another exception occurred:",
                (exc.__context__),
            )
        else:
            exc = None
    return list(reversed(found))


def _frames_only(exc: BaseException) -> str:
    """A traceback with each exception's class and frames, none of its messages."""
    parts: list[str] = []
    chain = _chain(exc)
    for i, (err, _) in enumerate(chain):
        if i:
            parts.append(f"\n{chain[i - 1][1]}\n\n")
        stack = traceback.extract_tb(err.__traceback__)
        if stack:
            parts.append("Traceback (most recent call last):\n")
            parts.extend(stack.format())
        parts.append(f"{type_path(err)} (message redacted)\n")
    return "".join(parts)


def _short_path(filename: str) -> str:
    """The file relative to the import root it lives under (no home directories in logs)."""
    path = Path(filename)
    best = None
    for root in sys.path:
        if not root:
            continue
        try:
            rel = path.relative_to(root)
        except ValueError:
            continue
        if best is None or len(rel.parts) < len(best.parts):
            best = rel
    return str(best) if best is not None else path.name
