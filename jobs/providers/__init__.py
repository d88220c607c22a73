"""Providers carry effects to the world: one small class each.

A *transactional* provider writes its effect to the database inside the same
transaction that marks the ledger row applied, so both commit or neither. An
external provider is called outside any transaction with the effect's
idempotency key; its outcome is recorded afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobs.models import Effect


class Provider:
    """Base class: subclasses set ``name`` and implement ``apply`` or ``send``."""

    name: str = ""
    transactional: bool = False
    # Whether a resend under the same key is deduplicated by the other side.
    supports_idempotency: bool = False
    # Most calls in flight at once across all workers (None: unbounded).
    max_in_flight: int | None = None

    def apply(self, effect: Effect) -> str:
        """Write the effect in the current transaction; return a reference."""
        raise NotImplementedError

    def send(self, effect: Effect) -> str:
        """Deliver the effect (raise on failure); return the provider's reference."""
        raise NotImplementedError


def register_builtin_providers() -> None:
    from jobs.providers.inapp import InAppProvider
    from jobs.registry import register_provider

    register_provider(InAppProvider())
