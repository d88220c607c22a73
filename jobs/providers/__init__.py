"""Providers carry effects to the world: one small class each.

A *transactional* provider writes its effect to the database inside the same
transaction that marks the ledger row applied, so both commit or neither. An
external provider is called outside any transaction with the effect's
idempotency key, inside one of its in-flight slots (``jobs.providers.bounds``);
its outcome is recorded afterwards.

Built in: ``inapp`` (database), ``webhook`` (the HTTP notice protocol in
DESIGN.md, settings ``NOTICE_PROVIDER_*``) and ``email`` (Django's mail backend).
Settings are read at call time, never at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured

from jobs.exceptions import JobError

if TYPE_CHECKING:
    from jobs.models import Effect


class ProviderError(JobError):
    """Base class for errors raised by providers; the class decides the retry."""

    code = "provider_error"


class ProviderNotConfigured(ProviderError, ImproperlyConfigured):
    """Raised when a provider is used while a setting it needs is missing."""

    error_class = "validation"
    code = "provider_not_configured"


class ProviderUnreachable(ProviderError):
    """Raised when the provider could not be reached: nothing was handed over."""

    error_class = "transport"
    code = "unreachable"


class ProviderTimeout(ProviderError):
    """Raised when the effect was handed over but no answer came back in time."""

    error_class = "provider_timeout"
    code = "no_answer"


class ProviderRejected(ProviderError):
    """Raised when the provider refused the effect as invalid; retrying cannot help."""

    error_class = "validation"
    code = "rejected"


class ProviderRefusedCredentials(ProviderError):
    """Raised when the provider refused our credentials; an operator must look."""

    error_class = "authorization"
    code = "credentials_refused"


class ProviderProtocolError(ProviderError):
    """Raised when the provider answered outside its protocol (e.g. no id)."""

    error_class = "unknown"
    code = "protocol_error"


class Provider:
    """Base class: subclasses set ``name`` and implement ``apply`` or ``send``."""

    name: str = ""
    transactional: bool = False
    # Whether a resend under the same key is deduplicated by the other side.
    supports_idempotency: bool = False
    # Most calls in flight at once across all workers (None: unbounded).
    max_in_flight: int | None = None

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


def register_builtin_providers() -> None:
    """Register ``inapp``, ``email`` and, where httpx is installed, ``webhook``."""
    from jobs.providers.email import EmailProvider
    from jobs.providers.inapp import InAppProvider
    from jobs.registry import register_provider

    register_provider(InAppProvider())
    register_provider(EmailProvider())
    try:  # the extra django-jobs-ledger[webhook]; jobs.checks names it when it is missing
        from jobs.providers.webhook import WebhookProvider
    except ModuleNotFoundError as exc:
        if exc.name != "httpx":
            raise
        return
    register_provider(WebhookProvider())
