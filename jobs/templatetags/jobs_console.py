"""Filters for the operations console: state names and durations as operators read them."""

from __future__ import annotations

from datetime import timedelta

from django import template

register = template.Library()


@register.filter
def state_label(state: str) -> str:
    """``retry_wait`` → ``retry wait``: the stored value, readable (still searchable)."""
    return str(state).replace("_", " ")


@register.filter
def duration(value: timedelta | None) -> str:
    """A short age: ``4 s``, ``3 min 20 s``, ``2 h 5 min``, ``3 d 4 h``."""
    if value is None:
        return "—"
    seconds = int(value.total_seconds())
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {seconds} s"
    return f"{seconds} s"
