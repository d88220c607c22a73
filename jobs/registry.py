"""Job kinds and providers, registered by the apps that own them.

Projects declare kinds with ``@jobs.kind`` in a ``jobkinds.py`` module (loaded
at start-up) or call ``register_kind`` from ``AppConfig.ready()``; the engine
looks them up by name, so ``jobs`` never imports the project.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobs.exceptions import PayloadInvalid, UnknownKind

if TYPE_CHECKING:
    from jobs.models import Effect
    from jobs.providers import Provider

# A kind's handler takes a ``jobs.JobContext`` (defined above this module, in the
# delivery, which imports the registry) and returns its effects.
Handler = Callable[[Any], "list[EffectSpec] | None"]


@dataclass(frozen=True)
class EffectSpec:
    """A business outcome the job asks for; it becomes a ledger row at publish."""

    name: str  # e.g. "completion-notice"
    provider: str  # a registered provider name
    recipient: str  # a reference (user id), never an address
    data: dict[str, Any] = field(default_factory=dict)  # references only

    def validate(self) -> None:
        """Raise PayloadInvalid unless this can become a ledger row; no database query.

        Called on what a handler returns, before publish: a bad effect fails the
        job once as ``validation`` with a reason an operator can read, instead of
        failing inside the publish transaction on every redelivery. The reason
        names the field, never its value (it could be an address).
        """
        from django.contrib.auth import get_user_model
        from django.core.exceptions import ValidationError

        where = f"effect {self.name!r}" if isinstance(self.name, str) else "an effect"
        if not isinstance(self.name, str) or not self.name or len(self.name) > 64:
            raise PayloadInvalid(f"{where}: name must be a non-empty string of at most 64 chars")
        if self.provider not in _providers:
            known = ", ".join(sorted(_providers)) or "none"
            raise PayloadInvalid(
                f"{where}: provider {str(self.provider)[:64]!r} is not registered (known: {known})"
            )
        recipient = str(self.recipient) if self.recipient is not None else ""
        user_pk = get_user_model()._meta.pk
        try:
            if not recipient or len(recipient) > 64:
                raise ValidationError("empty or too long")
            user_pk.to_python(recipient)
        except ValidationError:
            raise PayloadInvalid(
                f"{where}: recipient must be a user id (the primary key of "
                f"{get_user_model()._meta.label}), not an address or a name"
            ) from None
        if not isinstance(self.data, dict):
            raise PayloadInvalid(f"{where}: data must be a dict of references")
        try:
            json.dumps(self.data)
        except (TypeError, ValueError):
            raise PayloadInvalid(f"{where}: data must be JSON-serialisable") from None


def validate_effects(specs: list[EffectSpec]) -> list[EffectSpec]:
    """Validate what a handler returned (see ``EffectSpec.validate``); returns it."""
    for spec in specs:
        if not isinstance(spec, EffectSpec):
            raise PayloadInvalid(
                f"a job handler must return EffectSpec objects, not {type(spec).__name__}"
            )
        spec.validate()
    return specs


@dataclass(frozen=True)
class JobKind:
    name: str
    handler: Handler
    # Current policy for releasing an effect: a reason to withhold it, or None to send.
    authorize_release: Callable[[Effect], str | None] | None = None
    max_attempts: int | None = None
    # True, or a predicate on the exception: keep only its class and frames, no message.
    redact_errors: bool | Callable[[BaseException], bool] = False
    # Scheduling defaults for its jobs (docs/app/scheduling.md); a request may override.
    priority: int = 0
    queue: str = "default"
    # Seconds one attempt may run (None: the lease and Q_CLUSTER['timeout'] only).
    timeout: float | None = None
    # A periodic kind (docs/app/schedules.md): a cron expression or an interval, the cron's
    # time zone (None: TIME_ZONE) and which ticks missed while down to request.
    schedule: str | datetime.timedelta | None = None
    schedule_tz: str | None = None
    catch_up: str = "latest"


CATCH_UP = ("latest", "all")  # a periodic kind's ticks missed while down: the newest, or each
PRIORITY_RANGE = (-100, 100)  # Django's tasks contract: higher runs first
QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_priority(priority: object) -> int:
    """Raise ValueError unless ``priority`` is an int in Django's range (-100..100)."""
    low, high = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int) or not low <= priority <= high:
        raise ValueError(f"priority must be an integer from {low} to {high}, not {priority!r}")
    return priority


def check_queue(queue: object) -> str:
    """Raise ValueError unless ``queue`` is a queue name (letters, digits, ``_.-``; 64 max)."""
    if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
        raise ValueError(
            f"queue must be 1-64 letters, digits, '_', '.' or '-' (starting with a letter "
            f"or digit), not {str(queue)[:70]!r}"
        )
    return queue


_kinds: dict[str, JobKind] = {}
_providers: dict[str, Provider] = {}


def register_kind(
    name: str,
    handler: Handler,
    *,
    authorize_release: Callable[[Effect], str | None] | None = None,
    max_attempts: int | None = None,
    redact_errors: bool | Callable[[BaseException], bool] = False,
    priority: int = 0,
    queue: str = "default",
    timeout: float | None = None,
    schedule: str | datetime.timedelta | None = None,
    schedule_tz: str | None = None,
    catch_up: str = "latest",
) -> JobKind:
    """Register a job kind (idempotent, so ``ready()`` may run twice in tests).

    ``redact_errors``: the kind's exception messages may carry private values;
    True (or a predicate returning True for an exception) keeps only the class
    and the traceback's frames of its failures. ``schedule`` makes it periodic
    (``jobs.schedules``; its cron and time zone are read by check jobs.E040 at start-up).
    """
    if schedule is not None and not isinstance(schedule, str | datetime.timedelta):
        raise ValueError(f"schedule must be a cron string or a timedelta, not {schedule!r}")
    if catch_up not in CATCH_UP:
        raise ValueError(f"catch_up must be one of {', '.join(CATCH_UP)}, not {catch_up!r}")
    if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    kind = JobKind(
        name,
        handler,
        authorize_release,
        max_attempts,
        redact_errors,
        priority=check_priority(priority),
        queue=check_queue(queue),
        timeout=None if timeout is None else float(timeout),
        schedule=schedule,
        schedule_tz=schedule_tz,
        catch_up=catch_up,
    )
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


def register_builtin_providers() -> None:
    """Register ``inapp``, ``email`` and, where httpx is installed, ``webhook``."""
    from jobs.providers.email import EmailProvider
    from jobs.providers.inapp import InAppProvider

    register_provider(InAppProvider())
    register_provider(EmailProvider())
    try:  # the extra django-jobs-ledger[webhook]; jobs.checks names it when it is missing
        from jobs.providers.webhook import WebhookProvider
    except ModuleNotFoundError as exc:
        if exc.name != "httpx":
            raise
        return
    register_provider(WebhookProvider())
