"""Job kinds and providers, registered by the apps that own them.

The site registers its kinds in ``AppConfig.ready()``; the engine looks them
up by name, so ``jobs`` never imports the site.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobs.exceptions import UnknownKind

if TYPE_CHECKING:
    from jobs.models import Effect
    from jobs.providers import Provider
    from jobs.runner import JobContext


@dataclass(frozen=True)
class EffectSpec:
    """A business outcome the job asks for; it becomes a ledger row at publish."""

    name: str  # e.g. "completion-notice"
    provider: str  # a registered provider name
    recipient: str  # a reference (user id), never an address
    data: dict[str, Any] = field(default_factory=dict)  # references only


@dataclass(frozen=True)
class JobKind:
    name: str
    handler: Callable[[JobContext], list[EffectSpec] | None]
    # Current policy for releasing an effect: a reason to withhold it, or None to send.
    authorize_release: Callable[[Effect], str | None] | None = None
    max_attempts: int | None = None


_kinds: dict[str, JobKind] = {}
_providers: dict[str, Provider] = {}


def register_kind(
    name: str,
    handler: Callable[[JobContext], list[EffectSpec] | None],
    *,
    authorize_release: Callable[[Effect], str | None] | None = None,
    max_attempts: int | None = None,
) -> JobKind:
    """Register a job kind (idempotent, so ``ready()`` may run twice in tests)."""
    kind = JobKind(name, handler, authorize_release, max_attempts)
    _kinds[name] = kind
    return kind


def get_kind(name: str) -> JobKind:
    try:
        return _kinds[name]
    except KeyError:
        raise UnknownKind(f"no job kind named {name!r} is registered") from None


def kinds() -> dict[str, JobKind]:
    return dict(_kinds)


def register_provider(provider: Provider) -> Provider:
    _providers[provider.name] = provider
    return provider


def get_provider(name: str) -> Provider:
    try:
        return _providers[name]
    except KeyError:
        raise UnknownKind(f"no provider named {name!r} is registered") from None


def providers() -> dict[str, Provider]:
    return dict(_providers)
