"""The spans and instruments, with opentelemetry-api (imported only when it is installed).

One trace per job: ``jobs.request`` is its root where the web request asked for it; each
attempt (``jobs.attempt``, claim → handler → publish) is a child of that span, read
back from the job's row (``Job.trace_context``), and links to the attempt before it
(a span link, not a parent: attempts are siblings). Steps (``jobs.step``), the publish
(``jobs.publish``) and releases (``jobs.release``, ``jobs.lookup``) hang below.

What a span may carry is ids, names, states and classes: never a recipient's contact,
a payload, an error message or an idempotency key (only the first 16 hex digits of its
sha256, ``jobs.effect.key_sha256``, to find one effect's spans again).
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags

import jobs

log = logging.getLogger("jobs.telemetry")

_tracer: trace.Tracer | None = None
# Set by ``jobs.telemetry.configure``: the engine's own providers instead of the globals.
_providers: dict[str, Any] = {}
_counters: dict[str, Any] = {}
# The release span in progress, for its lookup to mark it "found" (no send).
_release_found: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jobs_release_found", default=None
)

COUNTERS = {
    "deliveries": "Deliveries that reached a worker, by kind, tenant and outcome",
    "duplicate_deliveries": "Second deliveries of a claimed job (recorded, did nothing)",
    "stale_attempts": "Attempts fenced out: their lease was lost, they published nothing",
    "effects_applied": "Effects the provider applied (a send's answer or a lookup's found)",
    "effects_suppressed": "Sends the ledger or a lookup made unnecessary (by=ledger|lookup)",
    "releases_withheld": "Releases withheld by the authorization recheck",
    "redriven": "Rows an operator's redrive made due again (and skipped, found applied)",
}


def use_providers(tracer_provider=None, meter_provider=None) -> None:
    """The providers the engine uses instead of the global ones (None: the global)."""
    _providers.clear()
    _providers.update(
        {k: v for k, v in (("tracer", tracer_provider), ("meter", meter_provider)) if v}
    )
    reset()


def _meter():
    provider = _providers.get("meter") or metrics.get_meter_provider()
    return provider.get_meter("jobs", jobs.__version__)


def configured() -> bool:
    """Whether the application set a tracer or a meter provider (else: off)."""
    if _providers:
        return True
    tracer_provider = trace.get_tracer_provider()
    tracing = not isinstance(tracer_provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
    meter_provider = type(metrics.get_meter_provider()).__name__
    metering = meter_provider not in ("_ProxyMeterProvider", "NoOpMeterProvider")
    return tracing or metering


def reset() -> None:
    """Forget the tracer and instruments (``jobs.telemetry.refresh``)."""
    global _tracer
    _tracer = None
    _counters.clear()


def tracer() -> trace.Tracer:
    global _tracer
    if _tracer is None:
        provider = _providers.get("tracer") or trace.get_tracer_provider()
        _tracer = provider.get_tracer("jobs", jobs.__version__)
    return _tracer


def counter(name: str):
    found = _counters.get(name)
    if found is None:
        meter = _meter()
        found = _counters[name] = meter.create_counter(f"jobs.{name}", description=COUNTERS[name])
    return found


def _add(name: str, attributes: dict[str, str], n: int = 1) -> None:
    try:
        counter(name).add(n, attributes)
    except Exception:  # never into the engine's path
        log.exception("telemetry: counting %s failed", name)


# --- trace context on the job row --------------------------------------------------------


def _traceparent(ctx: SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _parse(text: str) -> SpanContext | None:
    try:
        _, trace_id, span_id, flags = text.split("-")
        ctx = SpanContext(
            int(trace_id, 16),
            int(span_id, 16),
            is_remote=True,
            trace_flags=TraceFlags(int(flags, 16)),
        )
    except ValueError:
        return None
    return ctx if ctx.is_valid else None


def _stored(job) -> tuple[SpanContext | None, SpanContext | None]:
    """(the request's span, the last attempt's span) from ``Job.trace_context``."""
    parts = (getattr(job, "trace_context", "") or "").split()
    request = _parse(parts[0]) if parts and parts[0] != "-" else None
    previous = _parse(parts[1]) if len(parts) > 1 else None
    return request, previous


def current_traceparent() -> str:
    ctx = trace.get_current_span().get_span_context()
    return _traceparent(ctx) if ctx.is_valid else ""


def _remember_attempt(job, request: SpanContext | None, span: trace.Span) -> None:
    """Write this attempt's span on the row, for the next attempt's link (not a fenced
    write: no version bump, no arrow; the last attempt to start wins)."""
    from jobs.models import Job

    ctx = span.get_span_context()
    if not ctx.is_valid:
        return
    text = f"{_traceparent(request) if request else '-'} {_traceparent(ctx)}"
    Job.objects.filter(pk=job.pk).update(trace_context=text)
    job.trace_context = text


def _parent(request: SpanContext | None) -> otel_context.Context | None:
    if request is None:
        return None  # the current context: a new root, or the caller's span
    return trace.set_span_in_context(NonRecordingSpan(request))


def _job_attributes(job) -> dict[str, Any]:
    return {
        "jobs.kind": job.kind,
        "jobs.job.id": job.pk,
        "jobs.job.uid": str(job.uid),
        "jobs.job.revision": job.output_revision,
        "jobs.tenant": job.tenant_key,
    }


def _labels(job) -> dict[str, str]:
    return {"kind": job.kind, "tenant": job.tenant_key}


def _using(span: trace.Span):
    """Make ``span`` current and end it on exit; exceptions are recorded by class only."""
    return trace.use_span(
        span, end_on_exit=True, record_exception=False, set_status_on_exception=False
    )


def _error_type(span: trace.Span, exc: BaseException) -> None:
    """The exception's class only: its message may quote private data."""
    span.set_attribute("error.type", type(exc).__qualname__)
    span.set_status(trace.Status(trace.StatusCode.ERROR))


# --- the boundaries ----------------------------------------------------------------------


def request(fn, args, kwargs):
    """``jobs.request``: the span whose context the new job's row keeps."""
    kind = args[0] if args else kwargs.get("kind", "")
    span = tracer().start_span(
        "jobs.request",
        kind=SpanKind.PRODUCER,
        attributes={"jobs.kind": str(kind)},
        record_exception=False,
        set_status_on_exception=False,
    )
    with _using(span):
        try:
            handle = fn(*args, **kwargs)
        except BaseException as exc:
            _error_type(span, exc)
            raise
        span.set_attributes({**_job_attributes(handle.job), "jobs.created": handle.created})
        return handle


def _start_ns(attempt) -> int | None:
    """The claim's time (the attempt row's start, by the database's clock), if not later
    than now: the attempt span covers claim → handler → publish."""
    started = getattr(attempt, "started_at", None)
    if started is None:
        return None
    ns = int(started.timestamp() * 1e9)
    return min(ns, time.time_ns())


def attempt(fn, args, kwargs):
    """One attempt (``run_claim(claim, worker)``): a child of the request's span, linked
    to the previous attempt's."""
    claim = args[0] if args else kwargs["claim"]
    job, row = claim.job, claim.attempt
    request_ctx, previous = _stored(job)
    links = [Link(previous, {"jobs.link": "previous_attempt"})] if previous else []
    span = tracer().start_span(
        "jobs.attempt",
        context=_parent(request_ctx),
        kind=SpanKind.CONSUMER,
        links=links,
        start_time=_start_ns(row),
        attributes={
            **_job_attributes(job),
            "jobs.attempt.number": job.attempts,
            "jobs.attempt.id": row.pk,
            "jobs.worker": str(args[1] if len(args) > 1 else kwargs.get("worker", "")),
        },
    )
    try:
        _remember_attempt(job, request_ctx, span)
    except Exception:
        log.exception("telemetry: job=%s the attempt's trace context was not stored", job.pk)
    with _using(span):
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            _error_type(span, exc)
            raise
        span.set_attribute("jobs.outcome", str(result.outcome))
        labels = {**_labels(job), "outcome": str(result.outcome)}
        _add("deliveries", labels)
        if result.outcome == "lease_lost":
            _add("stale_attempts", _labels(job))
            span.set_attribute("jobs.fenced_out", True)
        return result


def publish(fn, args, kwargs):
    """The fenced publish of an attempt: ``jobs.publish``, with how many effects it wrote."""
    with tracer().start_as_current_span(
        "jobs.publish", record_exception=False, set_status_on_exception=False
    ) as span:
        result = fn(*args, **kwargs)
        span.set_attribute("jobs.published", result is not None)
        if result is not None:
            _published(span, args[0].job, result.effects)
        return result


def _published(span: trace.Span, job, effects: list) -> None:
    """Effects applied in the publish's own transaction (in-app notices) have no release
    span: counted here."""
    applied = [e for e in effects if e.state == "applied"]
    span.set_attributes(
        {"jobs.effects": len(effects), "jobs.effects.applied_with_publish": len(applied)}
    )
    for effect in applied:
        _add("effects_applied", {"provider": effect.provider, **_labels(job)})


def step(fn, args, kwargs):
    """One durable step (``steps.run(ctx, name, fn)``): ``jobs.step`` below the attempt."""
    ctx, name = args[0], args[1]
    with tracer().start_as_current_span(
        "jobs.step",
        attributes={
            "jobs.step.name": str(name),
            "jobs.job.id": ctx.job.pk,
            "jobs.step.lookup": kwargs.get("lookup") is not None,
        },
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            _error_type(span, exc)
            raise


def stage(name: str) -> None:
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(f"jobs.stage.{name.split(':', 1)[0]}")


def key_hash(key: str) -> str:
    """What a span says of an idempotency key: the first 16 hex digits of its sha256."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


OUTCOME_CLASS = {
    "applied": "applied",
    "withheld": "withheld",
    "deferred": "deferred",
    "pending": "retry",
    "unknown": "unknown",
    "failed": "refused",
    "needs_review": "needs_review",
    "lease_lost": "lease_lost",
    "skipped": "skipped",
}


def _effect_labels(effect) -> dict[str, str]:
    job = effect.job
    return {"provider": effect.provider, "kind": job.kind, "tenant": job.tenant_key}


def release(fn, args, kwargs):
    """One release (``send_claimed(effect, worker, prior)``): ``jobs.release``, a child of
    the current span (an attempt releasing inline) or of the job's request span."""
    effect = args[0]
    parent = None
    if not trace.get_current_span().is_recording():
        parent = _parent(_stored(effect.job)[0])
    found: list = []
    token = _release_found.set(found)
    span = tracer().start_span(
        "jobs.release",
        context=parent,
        kind=SpanKind.CLIENT,
        attributes={
            "jobs.provider": effect.provider,
            "jobs.effect.name": effect.name,
            "jobs.effect.pk": effect.pk,
            "jobs.job.id": effect.job_id,
            "jobs.effect.key_sha256": key_hash(effect.idempotency_key),
            "jobs.effect.prior_state": str(args[2] if len(args) > 2 else kwargs.get("prior", "")),
        },
    )
    try:
        with _using(span):
            try:
                outcome = fn(*args, **kwargs)
            except BaseException as exc:
                _error_type(span, exc)
                raise
            _released(span, effect, str(outcome), found=bool(found))
            return outcome
    finally:
        _release_found.reset(token)


def _released(span: trace.Span, effect, outcome: str, *, found: bool) -> None:
    cls = "found" if found and outcome == "applied" else OUTCOME_CLASS.get(outcome, outcome)
    span.set_attributes(
        {
            "jobs.outcome": outcome,
            "jobs.outcome_class": cls,
            "jobs.effect.attempt": effect.attempts,
        }
    )
    if effect.last_error_class:
        span.set_attribute("jobs.error_class", effect.last_error_class)
    labels = _effect_labels(effect)
    if outcome == "applied":
        _add("effects_applied", labels)
    if cls == "found":
        _add("effects_suppressed", {**labels, "by": "lookup"})
    elif outcome == "withheld":
        _add("releases_withheld", labels)


def claim_send(fn, args, kwargs):
    """``release(effect, worker)``: a claim the ledger refused (not releasable any more:
    applied, or another sender has it) is a send it suppressed."""
    outcome = fn(*args, **kwargs)
    if outcome == "skipped":
        _add("effects_suppressed", {**_effect_labels(args[0]), "by": "ledger"})
    return outcome


def lookup(fn, args, kwargs):
    """The question "what became of this key?" asked before a resend: ``jobs.lookup``."""
    effect = args[1]
    with tracer().start_as_current_span(
        "jobs.lookup",
        kind=SpanKind.CLIENT,
        attributes={
            "jobs.provider": effect.provider,
            "jobs.effect.key_sha256": key_hash(effect.idempotency_key),
        },
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            ref = fn(*args, **kwargs)
        except BaseException as exc:
            _error_type(span, exc)
            raise
        span.set_attribute("jobs.lookup.found", ref is not None)
        marks = _release_found.get()
        if ref is not None and marks is not None:
            marks.append(True)
        return ref


def count_duplicate_delivery(job) -> None:
    _add("duplicate_deliveries", _labels(job))


def count_redrive(counts: dict[str, int], *, target: str) -> None:
    for outcome, n in counts.items():
        if n:
            _add("redriven", {"target": target, "outcome": outcome}, n)


# --- gauges read from the tables (one process registers them) -----------------------------


def register_gauges() -> None:
    """Circuit state and duplicate effects as observable gauges, read from the tables at
    each collection: register them in one process only (every process reads the same
    rows)."""
    meter = _meter()
    meter.create_observable_gauge(
        "jobs.provider_circuit",
        callbacks=[_circuit_observations],
        description="1 for each provider circuit's current state (closed, open, half_open)",
    )
    meter.create_observable_gauge(
        "jobs.duplicate_effects",
        callbacks=[_duplicate_observations],
        description="Effect identities recorded or applied more than once (must stay 0)",
    )


def _circuit_observations(options):
    from jobs.telemetry import figures

    try:
        rows = figures.circuits()
    except Exception:
        log.exception("telemetry: reading the circuits failed")
        return []
    return [
        metrics.Observation(int(state == current), {"provider": provider, "state": state})
        for provider, current in rows.items()
        for state in ("closed", "open", "half_open")
    ]


def _duplicate_observations(options):
    from jobs.telemetry import figures

    try:
        rows = figures.duplicate_effects()
    except Exception:
        log.exception("telemetry: counting duplicate effects failed")
        return []
    return [metrics.Observation(n, {"provider": p}) for p, n in rows.items()]
