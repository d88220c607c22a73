"""The words people read for job and effect states and for providers: one table each.

The app's own words are neutral (job, result, effect, provider), so its console reads
right in any project. A kind names its job, result, effect and job states in its
project's words (``@jobs.kind(labels={...})``, ``jobs.registry.LABEL_KEYS``): the console
and the project's pages then say those for its jobs (``job_state_word(state, kind)``), so
the people of one project mean the same thing on both sides. The admin shows the engine's
state name beside the word (``Stopped · dead``), because operators filter and search by
it. A project may give a provider its own words too (``set_provider_words``), e.g. a
webhook that reaches a person's phone is their "Device".
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


# Job states (jobs.models.JOB_STATES), in lifecycle order: the words of a kind without
# labels (a kind's ``labels`` replace the word, never the tone).
JOB_STATE_WORDS: dict[str, StateWord] = {
    "queued": StateWord("Waiting", "queued"),
    "running": StateWord("Running", "running"),
    "retry_wait": StateWord("Retrying soon", "waiting"),
    "succeeded": StateWord("Done", "ready"),
    "failed": StateWord("Failed", "failed"),
    "dead": StateWord("Stopped", "failed"),
    "cancelled": StateWord("Cancelled", "cancelled"),
}

# Effect states (jobs.models.EFFECT_STATES).
EFFECT_STATE_WORDS: dict[str, StateWord] = {
    "pending": StateWord("Waiting to be sent", "queued"),
    "sending": StateWord("Being sent", "running"),
    "applied": StateWord("Delivered", "ready"),
    "unknown": StateWord("Delivery retrying", "waiting"),
    "withheld": StateWord("Not sent", "none"),
    "failed": StateWord("Could not be delivered", "failed"),
    "needs_review": StateWord("Being checked", "waiting"),
}


def kind_labels(kind: str) -> dict[str, str]:
    """The words kind ``kind`` gave (``labels=``); empty for an unknown or unlabelled kind."""
    from jobs import registry

    known = registry.kinds().get(kind) if kind else None
    return known.labels if known is not None else {}


def kind_noun(kind: str, noun: str) -> str:
    """What kind ``kind`` calls its ``noun`` ("job", "result", "effect"): "report"."""
    return kind_labels(kind).get(noun, noun)


def job_state_word(state: str, kind: str = "") -> StateWord:
    """The word for a job state, in kind ``kind``'s words when it gave one (an unknown
    state reads as itself, never a KeyError)."""
    shared = JOB_STATE_WORDS.get(state) or StateWord(str(state).replace("_", " "), "none")
    labelled = kind_labels(kind).get(state)
    return StateWord(labelled, shared.tone) if labelled else shared


def effect_state_word(state: str) -> StateWord:
    """The word for an effect state (an unknown one reads as itself)."""
    return EFFECT_STATE_WORDS.get(state) or StateWord(str(state).replace("_", " "), "none")


def state_tag(state: str, *, effect: bool = False, kind: str = "") -> SafeString:
    """The admin's status tag: the word (a job's in its kind's words), then the engine's
    state name (what filters and searches use), e.g. ``Stopped · dead``."""
    word = effect_state_word(state) if effect else job_state_word(state, kind)
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


def wait_words(seconds: float | None) -> str:
    """A wait read at a glance: ``40 ms``, ``2.5 s``, then as ``duration``."""
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    return duration(timedelta(seconds=seconds))


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


def held_words(job) -> str:
    """Why a waiting job is not claimed although its state says waiting: its sequence's
    turn or a paused scope (``Job.held_by``); "" when nothing holds it."""
    from jobs.models import SEQUENCE_HELD

    if not job.held_by or job.state not in ("queued", "retry_wait"):
        return ""
    if job.held_by == SEQUENCE_HELD:
        return f"waits its turn in sequence {job.sequence_key}"
    return f"held while {job.held_by} is paused"
