"""Filters for the operations console: state names and durations as operators read them.

The library stays here because Django finds template tag libraries only in an app's
``templatetags`` package (``{% load jobs_console %}``); the words are ``jobs.ops.words``.
"""

from __future__ import annotations

from django import template
from django.utils.safestring import SafeString

from jobs.ops import words

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
def job_state_tag(job) -> SafeString:
    """A job's status tag in its kind's words (``labels=``): "Ready · succeeded"."""
    return words.state_tag(job.state, kind=job.kind)


@register.filter
def kind_noun(kind: str, noun: str = "job") -> str:
    """What kind ``kind`` calls its ``noun`` ("job", "result", "effect")."""
    return words.kind_noun(kind, noun)


# ``4 s``, ``3 min 20 s``: the console's ages, in the same words as its health line.
register.filter("duration", words.duration)
register.filter("wait", words.wait_words)
