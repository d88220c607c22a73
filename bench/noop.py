"""The bare django-q2 task the engine is compared with: does nothing, touches no table."""

from __future__ import annotations


def noop() -> None:
    """Return at once."""
    return None
