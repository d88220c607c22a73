"""OpenTelemetry hooks of the engine: spans and instruments, or nothing at all.

The engine calls these at its stable boundaries (``jobs.request``, one attempt, one
durable step, one effect release, one lookup). Whether they do anything is decided
once, not per call:

- ``opentelemetry-api`` not importable (the ``[otel]`` extra not installed): each
  decorator returns the function it was given, unchanged, at import time; the other
  hooks are empty functions. Nothing runs per job.
- importable but off (no tracer or meter provider configured, or ``JOBS_TELEMETRY``
  False): the wrappers ask one cached boolean (``active``, resolved at the first call)
  and call straight through.
- on: ``jobs.telemetry.otel`` makes the spans and counts (docs/app/observability.md).

``refresh()`` resolves again (after configuring a provider late, or in tests). The
hooks never raise into the engine's path: a telemetry failure is logged and dropped.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("jobs.telemetry")

F = TypeVar("F", bound=Callable[..., Any])


def _importable() -> bool:
    """Whether opentelemetry-api can be imported (False when a test hides it)."""
    try:
        return importlib.util.find_spec("opentelemetry.trace") is not None
    except (ImportError, ValueError):  # a parent hidden in sys.modules (None) raises
        return False


AVAILABLE = _importable()
_active: bool | None = None  # resolved at the first call (settings and providers are set by then)


def _resolve() -> bool:
    from jobs import conf

    if not AVAILABLE or not conf.get("JOBS_TELEMETRY"):
        return False
    try:
        from jobs.telemetry import otel
    except ImportError:  # the API went away after import (a test hiding it)
        return False
    return otel.configured()


def active() -> bool:
    """Whether spans and instruments are recorded; resolved once, then a cached boolean."""
    global _active
    if _active is None:
        _active = _resolve()
    return _active


def refresh() -> bool:
    """Resolve ``active`` again: call after configuring a tracer or meter provider late."""
    global _active
    _active = None
    if AVAILABLE:
        try:
            from jobs.telemetry import otel

            otel.reset()
        except ImportError:
            pass
    return active()


def configure(*, tracer_provider: Any = None, meter_provider: Any = None) -> bool:
    """Use these providers (e.g. the SDK's, with an in-memory exporter in tests) instead
    of OpenTelemetry's global ones; with neither, back to the globals. Returns ``active()``."""
    if AVAILABLE:
        from jobs.telemetry import otel

        otel.use_providers(tracer_provider, meter_provider)
    return refresh()


def _traced(name: str) -> Callable[[F], F]:
    """A decorator that leaves ``fn`` as it is without the API, and otherwise hands each
    call to ``otel.<name>`` while ``active()``."""

    def decorate(fn: F) -> F:
        if not AVAILABLE:
            return fn  # absent: no wrapper at all

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if _active is False or (_active is None and not active()):
                return fn(*args, **kwargs)
            from jobs.telemetry import otel

            return getattr(otel, name)(fn, args, kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


# The boundaries (one decorator line each in the engine's modules).
traced_request = _traced("request")  # jobs.api.request
traced_attempt = _traced("attempt")  # jobs.delivery.runner.run_claim
traced_publish = _traced("publish")  # jobs.delivery.runner._publish
traced_step = _traced("step")  # jobs.delivery.steps.run
traced_release = _traced("release")  # jobs.delivery.release.send_claimed
traced_claim_send = _traced("claim_send")  # jobs.delivery.release.release
traced_lookup = _traced("lookup")  # jobs.delivery.release._look_up


def request_traceparent() -> str:
    """The current span's W3C traceparent, stored on a new job's row ('' when off)."""
    if not active():
        return ""
    from jobs.telemetry import otel

    return otel.current_traceparent()


def stage(name: str) -> None:
    """A handler stage (``ctx.stage``): an event on the current attempt or step span."""
    if _active is False or (_active is None and not active()):
        return
    from jobs.telemetry import otel

    otel.stage(name)


def duplicate_delivery(job) -> None:
    """A second delivery of a claimed job was recorded (it did nothing else)."""
    if _active is False or (_active is None and not active()):
        return
    from jobs.telemetry import otel

    otel.count_duplicate_delivery(job)


def redrive_done(counts: dict[str, int], *, target: str) -> None:
    """An operator's redrive of a group: its counts, as instruments."""
    if not active():
        return
    from jobs.telemetry import otel

    otel.count_redrive(counts, target=target)


def register_gauges() -> bool:
    """Register the table-read gauges (circuit state, duplicate effects) with the meter
    provider; call it in one process (e.g. the web process). False without the API."""
    if not AVAILABLE:
        return False
    from jobs.telemetry import otel

    otel.register_gauges()
    return True
