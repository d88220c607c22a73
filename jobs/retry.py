"""The retry table: which failures are safe to retry, and how long to wait.

Pure functions: no database, the random source passed in, so the policy is
testable on its own and lives in exactly one place.
"""

from __future__ import annotations

import email.utils
import errno
import os
import random
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum

from jobs.exceptions import JobError
from jobs.failures import Redact, original, should_redact


class ErrorClass(StrEnum):
    TRANSPORT = "transport"
    TEMPORARY = "temporary"
    PROVIDER_TIMEOUT = "provider_timeout"
    VALIDATION = "validation"
    AUTHORIZATION = "authorization"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Rule:
    """One row of the table: what a failure of this class means for a job and for an effect."""

    retry: bool  # another try may succeed, within the attempt budget
    may_have_landed: bool  # a failed call may still have taken effect: retry under the same key
    job_final: str  # the job's state when it is not retried: "failed" or "dead"
    effect_final: str  # the effect's state when it is not retried
    meaning: str

    @property
    def safe_to_retry(self) -> bool:
        return self.retry


POLICY: dict[ErrorClass, Rule] = {
    ErrorClass.TRANSPORT: Rule(
        True, False, "dead", "needs_review", "connection reset, DNS, TLS: nothing was processed"
    ),
    ErrorClass.TEMPORARY: Rule(
        True,
        False,
        "dead",
        "needs_review",
        "HTTP 429/503, database or artifact storage unavailable, deadlock, serialization",
    ),
    ErrorClass.PROVIDER_TIMEOUT: Rule(
        True,
        True,
        "dead",
        "needs_review",
        "sent, no answer: retry with the same key; without key support, operator review",
    ),
    ErrorClass.VALIDATION: Rule(
        False, False, "failed", "failed", "malformed payload or HTTP 400/409/422: permanent"
    ),
    ErrorClass.AUTHORIZATION: Rule(
        False, False, "failed", "withheld", "access revoked or HTTP 401/403: nothing released"
    ),
    ErrorClass.UNKNOWN: Rule(
        True, True, "dead", "needs_review", "anything else: retried up to the budget, then review"
    ),
}

# Codes whose meaning is narrower than their class (looked up before POLICY).
CODE_RULES: dict[str, Rule] = {
    # A missing setting is no refusal by the other side: fix it, then "send again".
    "provider_not_configured": Rule(
        False, False, "failed", "needs_review", "a provider setting is missing"
    ),
    # A handler or task that tries to end the process (sys.exit(), exit()) or misuses a
    # generator's exit: a bug in that code, the same on every try. The worker lives on.
    "SystemExit": Rule(
        False, False, "failed", "needs_review", "the code tried to exit the worker process"
    ),
    "GeneratorExit": Rule(
        False, False, "failed", "needs_review", "GeneratorExit escaped the handler"
    ),
}
# BaseExceptions that are not Exceptions, by the code they get (the class name).
PROCESS_EXITS = ("SystemExit", "GeneratorExit")

# What an operator reads on an effect that stopped, by code or class (the code is appended).
_EFFECT_REASONS = {
    "http_409": "the provider saw this idempotency key with a different body",
    ErrorClass.VALIDATION: "the provider rejected the notice as invalid",
    ErrorClass.AUTHORIZATION: "not released: the provider refused our credentials or the "
    "recipient's access",
}


def job_outcome(
    c: Classified,
    *,
    attempts: int,
    max_attempts: int,
    outage_for: float | None = None,
    outage_window: float = 0.0,
) -> str:
    """The job's next state after a failed attempt.

    ``retry_wait``, ``failed``, ``dead``, or ``outage_wait``: a retry_wait that does
    not spend the attempt, because a dependency (database, artifact storage) is
    down. Outages are budgeted by time, not attempts: ``outage_for`` seconds since
    this outage began (None: it begins now), against ``outage_window``; past the
    window the attempt counts again.
    """
    rule = c.rule
    if not rule.retry:
        return rule.job_final
    if c.outage and (outage_for or 0.0) < outage_window:
        return "outage_wait"
    return "retry_wait" if attempts < max_attempts else "dead"


@dataclass(frozen=True)
class EffectOutcome:
    state: str  # pending | unknown | failed | withheld | needs_review
    reason: str

    @property
    def retry(self) -> bool:
        return self.state in ("pending", "unknown")


def effect_outcome(
    c: Classified, *, attempts: int, max_attempts: int, called: bool, dedupes: bool, unsure: bool
) -> EffectOutcome:
    """An effect's next state after a failed release, from the same table as the job's.

    ``called``: the provider was called (not a failure before the call);
    ``dedupes``: the provider deduplicates by idempotency key;
    ``unsure``: an earlier send may already have landed (the effect was ``unknown``).
    """
    rule = c.rule
    landed = unsure or (called and rule.may_have_landed)
    if not rule.retry:
        why = c.detail or _EFFECT_REASONS.get(c.code) or _EFFECT_REASONS.get(c.error_class)
        why = why or rule.meaning
        return EffectOutcome(rule.effect_final, f"{why} ({c.code})")
    if landed and not dedupes:
        return EffectOutcome(
            "needs_review", f"sent without an answer; the provider cannot deduplicate ({c.code})"
        )
    if attempts >= max_attempts:
        return EffectOutcome("needs_review", f"send attempts exhausted (last: {c.code})")
    if landed:
        return EffectOutcome("unknown", f"no answer; will retry with the same key ({c.code})")
    return EffectOutcome("pending", "")


# Storage errors that mean "the disk is full or read-only for now": an outage, not a bug.
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.ENFILE, errno.EMFILE}

# Every outage, one rule: a failure whose code names a dependency that is down (the
# database, the artifact storage) waits, budgeted by time (``job_outcome``), not by
# attempts. By code prefix, the same for every way the dependency fails: a refused
# or cut database connection (SQLSTATE classes 08, 57P, 53), a full or read-only disk
# (``storage_enospc``), a storage that cannot be read or written now, a disk error
# (``storage_eio``, ``storage_estale``) or an object store refusing connections,
# answering 5xx or timing out (``storage_unavailable``, jobs.exceptions.StorageUnavailable).
OUTAGES: dict[str, str] = {
    "db_unavailable": "database",
    "pg_08": "database",
    "pg_57P": "database",
    "pg_53": "database",
    "storage_": "artifact storage",
}


def outage_of(code: str) -> str:
    """The dependency a failure with this code says is down, or "" (no outage)."""
    for prefix, dependency in OUTAGES.items():
        if code.startswith(prefix):
            return dependency
    return ""


# SQLSTATEs that mean "the same statement may succeed if tried again".
_RETRYABLE_SQLSTATES = {
    "40P01": "deadlock",
    "40001": "serialization",
    "55P03": "lock_not_available",
}


@dataclass(frozen=True)
class Classified:
    error_class: ErrorClass
    code: str
    detail: str = ""
    retry_after: float | None = None
    outage: bool = False  # a dependency is down (``OUTAGES``): wait, budgeted by time

    @property
    def rule(self) -> Rule:
        return CODE_RULES.get(self.code) or POLICY[self.error_class]


def classify_status(status: int, retry_after: float | None = None) -> Classified:
    """Map an HTTP status from a provider to its retry class."""
    code = f"http_{status}"
    if status in (429, 503):
        return Classified(ErrorClass.TEMPORARY, code, retry_after=retry_after)
    if status in (401, 403):
        return Classified(ErrorClass.AUTHORIZATION, code)
    if status in (400, 409, 422):
        return Classified(ErrorClass.VALIDATION, code)
    if 500 <= status < 600:
        return Classified(ErrorClass.TEMPORARY, code, retry_after=retry_after)
    return Classified(ErrorClass.UNKNOWN, code)


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def classify(exc: BaseException, *, redact: Redact = False) -> Classified:
    """Map an exception to its retry class; the code names the cause, never the data.

    Whether it is an outage is decided by its code alone (``OUTAGES``), whichever rule
    below named it. ``redact`` (the kind's ``redact_errors``, as ``jobs.failures.capture``
    takes it): a ``JobError``'s text is the raiser's, and a handler may quote what it read
    (``PayloadInvalid(f"no such phone {phone}")``), so a redacting kind keeps no detail of
    any exception, the engine's own included: only its class and code.
    """
    c = _classify(exc)
    outage = bool(outage_of(c.code)) and c.error_class == ErrorClass.TEMPORARY
    if c.outage != outage:
        c = replace(c, outage=outage)
    if c.detail and should_redact(original(exc), redact):
        c = replace(c, detail="")
    return c


def _classify(exc: BaseException) -> Classified:
    if not isinstance(exc, Exception):
        name = type(exc).__name__
        for base in type(exc).__mro__:
            if base.__name__ in PROCESS_EXITS and base.__module__ == "builtins":
                name = base.__name__
                break
        return Classified(ErrorClass.UNKNOWN, name[:64])
    for err in _chain(exc):
        if isinstance(err, JobError) and err.error_class:
            return Classified(
                ErrorClass(err.error_class),
                err.code,
                detail=err.detail[:300],
                retry_after=getattr(err, "retry_after", None),
            )
        sqlstate = getattr(err, "sqlstate", None)
        if sqlstate:
            if sqlstate in _RETRYABLE_SQLSTATES:
                return Classified(ErrorClass.TEMPORARY, f"pg_{sqlstate}")
            if sqlstate.startswith(("08", "57P", "53")):  # connection, shutdown, resources
                return Classified(
                    ErrorClass.TEMPORARY,
                    f"pg_{sqlstate}",
                    detail=f"database unavailable (SQLSTATE {sqlstate})",
                )
        if isinstance(err, OSError) and err.errno in _STORAGE_ERRNOS:
            name = errno.errorcode[err.errno]
            # strerror only: the exception's text may name a file, and names may be private.
            return Classified(
                ErrorClass.TEMPORARY,
                f"storage_{name.lower()}",
                detail=f"storage unavailable: {os.strerror(err.errno)} ({name})",
            )
        http = _classify_httpx(err)
        if http is not None:
            return http
    for err in _chain(exc):
        name = type(err).__name__
        if name in ("OperationalError", "InterfaceError") and type(err).__module__.startswith(
            ("django.db", "psycopg", "sqlite3")
        ):
            # Connection lost or database locked: the database is temporarily unavailable.
            return Classified(
                ErrorClass.TEMPORARY, "db_unavailable", detail=f"database unavailable ({name})"
            )
        if isinstance(err, TimeoutError):
            return Classified(ErrorClass.PROVIDER_TIMEOUT, "timeout")
        if isinstance(err, ConnectionError):
            return Classified(ErrorClass.TRANSPORT, name.lower())
    return Classified(ErrorClass.UNKNOWN, type(exc).__name__[:64])


def _classify_httpx(err: BaseException) -> Classified | None:
    try:
        import httpx
    except ImportError:  # pragma: no cover - httpx is a dependency
        return None
    if isinstance(err, httpx.HTTPStatusError):
        response = err.response
        return classify_status(
            response.status_code, parse_retry_after(response.headers.get("Retry-After"))
        )
    if isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)):
        return Classified(ErrorClass.TRANSPORT, type(err).__name__.lower())
    if isinstance(err, httpx.TimeoutException):  # read/write timeout: the request was sent
        return Classified(ErrorClass.PROVIDER_TIMEOUT, type(err).__name__.lower())
    if isinstance(err, httpx.RemoteProtocolError):  # dropped mid-answer: it may have landed
        return Classified(ErrorClass.PROVIDER_TIMEOUT, "remote_protocol_error")
    if isinstance(err, httpx.TransportError):
        return Classified(ErrorClass.TRANSPORT, type(err).__name__.lower())
    return None


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    now = now or datetime.now(UTC)
    return max(0.0, (when - now).total_seconds())


def backoff_delay(
    attempt: int,
    *,
    floor: float,
    base: float,
    cap: float,
    retry_after: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Delay before retry number ``attempt`` (1-based): floor + full jitter, capped.

    The floor means never an immediate retry; full jitter spreads workers that
    failed together; Retry-After from the other side is a lower bound.
    """
    rng = rng or random
    window = min(cap, base * (2 ** max(0, attempt - 1)))
    delay = min(cap, floor + rng.uniform(0, window))
    if retry_after is not None:
        delay = max(delay, retry_after)
    return delay
