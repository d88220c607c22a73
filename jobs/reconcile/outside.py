"""The providers' side of a failover: keys they accepted that the ledger lacks.

A provider with a listing (``Provider.accepted_since``) is asked for what it applied from
a time on; an operator can also hand in a provider's export (``read_provider_keys``).
Either way ``unknown_keys`` keeps the keys no effect of the ledger has: notices of
effects the database lost. Keys are compared, never logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jobs import archive, registry
from jobs.exceptions import ProviderError, ProviderNotConfigured
from jobs.models import Effect

log = logging.getLogger("jobs.reconcile")


@dataclass(frozen=True)
class UnknownKey:
    """A key a provider accepted that no effect of the ledger has."""

    idempotency_key: str
    effect_id: str  # as the provider recorded it ("" when its export has none)
    job: str  # the job part of that effect id (its uid), or ""
    provider: str = ""  # the provider that listed it ("" for an export)
    reference: str = ""  # the provider's id of the send, when it listed one


def read_provider_keys(lines) -> list[tuple[str, str]]:
    """``(key, effect id)`` pairs from a provider's export: a key a line, optionally
    followed by whitespace and the effect id; blank lines and ``#`` comments skipped."""
    pairs = []
    for line in lines:
        parts = line.split(None, 1)
        if not parts or parts[0].startswith("#"):
            continue
        pairs.append((parts[0], parts[1].strip() if len(parts) > 1 else ""))
    return pairs


def unknown_keys(
    accepted: list[tuple[str, str]], *, provider: str = "", refs: dict[str, str] | None = None
) -> list[UnknownKey]:
    """The accepted ``(key, effect id)`` pairs whose key no effect of the ledger has."""
    keys = {key for key, _ in accepted}
    known: set[str] = set()
    for chunk in chunks(sorted(keys), 1000):
        known.update(
            Effect.objects.filter(idempotency_key__in=chunk).values_list(
                "idempotency_key", flat=True
            )
        )
    out, seen = [], set()
    for key, effect_id in accepted:
        if key in known or key in seen:
            continue
        if effect_id and (archive.archived_effect(effect_id) or ("",))[0] == key:
            continue  # an archived job's effect: its record keeps the key (issue 46)
        seen.add(key)
        job = effect_id.split(":", 1)[0] if effect_id else ""
        out.append(UnknownKey(key, effect_id, job, provider, (refs or {}).get(key, "")))
    return out


def listed_keys(since: float) -> tuple[list[UnknownKey], dict[str, str]]:
    """Ask every external provider that lists (``supports_listing``) what it applied from
    ``since`` on; returns the keys the ledger lacks and, per provider, what it answered
    (``listed N``, ``no listing``, ``not asked: <class>``)."""
    found: list[UnknownKey] = []
    answers: dict[str, str] = {}
    for name, provider in sorted(registry.providers().items()):
        if provider.transactional or not getattr(provider, "supports_listing", False):
            continue
        try:
            accepted = provider.accepted_since(since)
        except ProviderNotConfigured:  # a built-in provider this site does not use
            continue
        except ProviderError as exc:  # not configured, away: reported, the rest goes on
            answers[name] = f"not asked: {type(exc).__name__}"
            log.warning("reconcile provider=%s listing failed: %s", name, type(exc).__name__)
            continue
        if accepted is None:
            answers[name] = "no listing"
            continue
        answers[name] = f"listed {len(accepted)}"
        refs = {a.idempotency_key: a.reference for a in accepted}
        pairs = [(a.idempotency_key, a.effect_id) for a in accepted]
        found += unknown_keys(pairs, provider=name, refs=refs)
    return found, answers


def chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]
