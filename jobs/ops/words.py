"""The words people read for job and effect states and for providers: one table each.

The reviewer pages and the operators' admin say the same word for the same state (a
dead job is "Stopped" on both sides), so a reviewer and an operator talking about
one report mean the same thing. The admin shows the engine's state name beside the
word (``Stopped · dead``), because operators filter and search by it. A site imports
these (``jobs`` imports nothing from a site) and adds its own explanations around
them; a site may give a provider its own words (``set_provider_words``), e.g. a
webhook that reaches the reviewer's phone is their "Device".
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.utils.html import format_html
from django.utils.safestring import SafeString


@dataclass(frozen=True)
class StateWord:
    """A state as people read it: the word and the status tag's tone (its colour class)."""

    word: str
    tone: str  # queued, running, waiting, ready, failed, cancelled, none


# Job states (jobs.models.JOB_STATES), in lifecycle order.
JOB_STATE_WORDS: dict[str, StateWord] = {
    "queued": StateWord("Requested", "queued"),
    "running": StateWord("Being prepared", "running"),
    "retry_wait": StateWord("Retrying soon", "waiting"),
    "succeeded": StateWord("Ready", "ready"),
    "failed": StateWord("Could not be built", "failed"),
    "dead": StateWord("Stopped", "failed"),
    "cancelled": StateWord("Cancelled", "cancelled"),
}

# Effect (notice) states (jobs.models.EFFECT_STATES).
EFFECT_STATE_WORDS: dict[str, StateWord] = {
    "pending": StateWord("Waiting to be sent", "queued"),
    "sending": StateWord("Being sent", "running"),
    "applied": StateWord("Delivered", "ready"),
    "unknown": StateWord("Delivery retrying", "waiting"),
    "withheld": StateWord("Not sent", "none"),
    "failed": StateWord("Could not be delivered", "failed"),
    "needs_review": StateWord("Being checked", "waiting"),
}


def job_state_word(state: str) -> StateWord:
    """The word for a job state (an unknown one reads as itself, never a KeyError)."""
    return JOB_STATE_WORDS.get(state) or StateWord(str(state).replace("_", " "), "none")


def effect_state_word(state: str) -> StateWord:
    """The word for an effect state (an unknown one reads as itself)."""
    return EFFECT_STATE_WORDS.get(state) or StateWord(str(state).replace("_", " "), "none")


def state_tag(state: str, *, effect: bool = False) -> SafeString:
    """The admin's status tag: the shared word, then the engine's state name (what filters
    and searches use), e.g. ``Stopped · dead``."""
    word = (effect_state_word if effect else job_state_word)(state)
    return format_html(
        '<span class="jobs-state jobs-state--{} jobs-tone--{}">{}'
        ' <span class="jobs-state__engine">· {}</span></span>',
        state,
        word.tone,
        word.word,
        str(state).replace("_", " "),
    )


@dataclass(frozen=True)
class ProviderWords:
    """A provider as people read it: a label ("Device") and a place ("your device")."""

    label: str
    place: str


_PROVIDER_WORDS: dict[str, ProviderWords] = {
    "inapp": ProviderWords("Inbox", "inbox"),
    "email": ProviderWords("E-mail", "e-mail"),
    "webhook": ProviderWords("Webhook", "webhook endpoint"),
}


def set_provider_words(name: str, label: str, place: str) -> None:
    """Let a site name a provider in its people's words (both sides then use them)."""
    _PROVIDER_WORDS[name] = ProviderWords(label, place)


def provider_words(name: str) -> ProviderWords:
    """The words for provider ``name`` (an unregistered one reads as its name)."""
    return _PROVIDER_WORDS.get(name) or ProviderWords(name, name)


def provider_tag(name: str) -> SafeString:
    """The admin's provider cell: the label, then the provider's engine name."""
    words = provider_words(name)
    if words.label == name:
        return format_html("{}", name)
    return format_html('{} <span class="jobs-state__engine">· {}</span>', words.label, name)


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


def progress_words(done: int | None, total: int | None, note: str = "") -> str:
    """A handler's progress as read: ``3 of 4 (75%): render``, ``7``, or "—" before any."""
    if done is None and total is None and not note:
        return "—"
    counts = f"{done or 0} of {total}" if total else f"{done or 0}"
    if total and done is not None:
        counts += f" ({min(100, round(100 * done / total))}%)"
    return counts + (f": {note}" if note else "")


def job_progress(job) -> str:
    """A job's last reported progress (``ctx.progress``), or "—" when it reported none."""
    if job.progress_at is None:
        return "—"
    return progress_words(job.progress_done, job.progress_total, job.progress_note)
