"""Providers carry effects to the world: one small class each.

A *transactional* provider writes its effect to the database inside the same
transaction that marks the ledger row applied, so both commit or neither. An
external provider is called outside any transaction with the effect's
idempotency key, inside one of its in-flight slots (``jobs.providers.bounds``);
its outcome is recorded afterwards.

An external provider may also answer *what became of a key* (``supports_lookup``,
``lookup``): the release path asks it before sending again an effect whose outcome is
unknown, so a send that landed without an answer is recorded, not repeated.

Built in: ``inapp`` (database), ``webhook`` (the HTTP notice protocol in
DESIGN.md, settings ``NOTICE_PROVIDER_*``) and ``email`` (Django's mail backend).
Settings are read at call time, never at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

# The provider errors are part of the one hierarchy in ``jobs.exceptions``; importable
# from here too, where provider authors look for them.
from jobs.exceptions import (
    ProviderError,
    ProviderLookupUnsupported,
    ProviderNotConfigured,
    ProviderProtocolError,
    ProviderRefusedCredentials,
    ProviderRejected,
    ProviderTimeout,
    ProviderUnreachable,
)

if TYPE_CHECKING:
    from jobs.models import Effect

__all__ = [
    "Accepted",
    "Provider",
    "ProviderError",
    "ProviderLookupUnsupported",
    "ProviderNotConfigured",
    "ProviderProtocolError",
    "ProviderRefusedCredentials",
    "ProviderRejected",
    "ProviderTimeout",
    "ProviderUnreachable",
]


@dataclass(frozen=True)
class Accepted:
    """One send a provider says it applied, as its listing (``accepted_since``) names it."""

    idempotency_key: str
    reference: str  # the provider's id of the send
    effect_id: str  # as the body named it ("" when the listing has none)
    applied_at: float  # Unix seconds, by the provider's clock


class Provider:
    """Base class: subclasses set ``name`` and implement ``apply`` or ``send``."""

    name: str = ""
    transactional: bool = False
    # Whether a resend under the same key is deduplicated by the other side.
    supports_idempotency: bool = False
    # Whether ``lookup`` can say what became of an idempotency key (see ``lookup``).
    supports_lookup: bool = False
    # Whether ``accepted_since`` can list the keys it applied from a time on (issue 47).
    supports_listing: bool = False
    # Most calls in flight at once across all workers (None: unbounded).
    max_in_flight: int | None = None
    # The effect is one in-app ``Notice`` row (``notice_for``) that the publish inserts
    # itself, in its statement or transaction; else ``apply`` runs (transactional) or
    # ``send`` (external).
    notice_in_plan: bool = False

    def in_flight_limit(self) -> int | None:
        """The bound on simultaneous calls, read at call time (None: unbounded)."""
        return self.max_in_flight

    def apply(self, effect: Effect) -> str:
        """Write the effect in the current transaction; return a reference."""
        raise NotImplementedError

    def prepare(self, effect: Effect) -> None:
        """Slow set-up for a send (a client, its TLS context), done before the rate's start
        is taken: the call must follow its start at once, or calls taken apart reach the
        provider together. Raising here fails the send before any call."""

    def send(self, effect: Effect) -> str:
        """Deliver the effect (raise on failure); return the provider's reference."""
        raise NotImplementedError

    def lookup(self, idempotency_key: str) -> str | None:
        """What the provider did with ``idempotency_key``: its reference when it applied
        a send under the key, None when it never saw the key.

        Asked before an effect whose outcome is unknown is sent again, so an answer lost
        on the way back costs no second request. Raise a ``ProviderError`` when the
        provider could not say (the effect stays unknown and is asked again later), or
        ``ProviderLookupUnsupported`` when it has no lookup (the send goes ahead, as for a
        provider without ``supports_lookup``). Never called unless ``supports_lookup``.
        """
        raise NotImplementedError

    def accepted_since(self, since: float) -> list[Accepted] | None:
        """Every send the provider applied from ``since`` (Unix seconds) on, oldest first;
        None when it turns out to have no listing.

        Optional (``supports_listing``): ``jobs_reconcile`` compares it with the ledger
        after a failover, to find the notices of effects the database lost. Raise a
        ``ProviderError`` when the provider could not answer now.
        """
        return None
