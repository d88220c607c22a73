"""Filters for the operations console: state names and durations as operators read them."""

from __future__ import annotations

from datetime import timedelta

from django import template
from django.utils.safestring import SafeString

from jobs import words

register = template.Library()


@register.filter
def state_label(state: str) -> str:
    """``retry_wait`` → ``retry wait``: the stored value, readable (still searchable)."""
    return str(state).replace("_", " ")


@register.filter
def state_word(state: str, model: str = "job") -> str:
    """The shared word for a job (or, with ``"effect"``, an effect) state: "Stopped"."""
    table = words.effect_state_word if model == "effect" else words.job_state_word
    return table(state).word


@register.filter
def state_tag(state: str, model: str = "job") -> SafeString:
    """The admin's status tag: the shared word and the engine's name ("Stopped · dead")."""
    return words.state_tag(state, effect=model == "effect")


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
