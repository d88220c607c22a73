"""The retry table on its own: pure functions, no database."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import httpx
import psycopg.errors
import pytest
from django.db import OperationalError

from jobs.exceptions import NotAuthorized, PayloadInvalid, StorageUnavailable, TemporaryFailure
from jobs.retry import (
    POLICY,
    Classified,
    ErrorClass,
    backoff_delay,
    classify,
    effect_outcome,
    job_outcome,
    outage_of,
    parse_retry_after,
)


def _status_error(status: int, retry_after: str | None = None) -> httpx.HTTPStatusError:
    headers = {"Retry-After": retry_after} if retry_after else {}
    request = httpx.Request("POST", "http://127.0.0.1:9/notices")
    response = httpx.Response(status, headers=headers, request=request)
    return httpx.HTTPStatusError("status", request=request, response=response)


def _wrapped(inner: BaseException) -> BaseException:
    """Django wraps driver errors; the class must survive the wrapping."""
    try:
        try:
            raise inner
        except BaseException as exc:
            raise OperationalError(str(exc)) from exc
    except OperationalError as outer:
        return outer


@pytest.mark.parametrize(
    ("exc", "error_class", "code"),
    [
        (_wrapped(psycopg.errors.DeadlockDetected()), ErrorClass.TEMPORARY, "pg_40P01"),
        (_wrapped(psycopg.errors.SerializationFailure()), ErrorClass.TEMPORARY, "pg_40001"),
        (OperationalError("server closed the connection"), ErrorClass.TEMPORARY, "db_unavailable"),
        (ConnectionResetError(), ErrorClass.TRANSPORT, "connectionreseterror"),
        (httpx.ConnectError("refused"), ErrorClass.TRANSPORT, "connecterror"),
        (httpx.ReadTimeout("slow"), ErrorClass.PROVIDER_TIMEOUT, "readtimeout"),
        (_status_error(503), ErrorClass.TEMPORARY, "http_503"),
        (_status_error(429), ErrorClass.TEMPORARY, "http_429"),
        (_status_error(422), ErrorClass.VALIDATION, "http_422"),
        (_status_error(400), ErrorClass.VALIDATION, "http_400"),
        (_status_error(409), ErrorClass.VALIDATION, "http_409"),
        (_status_error(401), ErrorClass.AUTHORIZATION, "http_401"),
        (_status_error(403), ErrorClass.AUTHORIZATION, "http_403"),
        (PayloadInvalid("params.x must be an integer"), ErrorClass.VALIDATION, "payload_invalid"),
        (NotAuthorized("revoked"), ErrorClass.AUTHORIZATION, "not_authorized"),
        (TemporaryFailure("down"), ErrorClass.TEMPORARY, "temporary"),
        (KeyError("applicant_phone"), ErrorClass.UNKNOWN, "KeyError"),
    ],
)
def test_classify__maps_each_failure_to_its_class(exc, error_class, code):
    c = classify(exc)
    assert (c.error_class, c.code) == (error_class, code)


def test_classify__never_copies_an_unknown_exception_message():
    c = classify(ValueError("applicant phone +1 555 0100 is odd"))
    assert "555" not in c.code and c.detail == ""


def test_classify__honours_retry_after_seconds():
    assert classify(_status_error(503, "7")).retry_after == 7.0


def test_parse_retry_after__http_date():
    now = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
    assert parse_retry_after("Sun, 29 Nov 2026 12:00:30 GMT", now=now) == 30.0
    assert parse_retry_after("nonsense", now=now) is None


def test_policy__permanent_classes_do_not_retry():
    assert not POLICY[ErrorClass.VALIDATION].retry
    assert not POLICY[ErrorClass.AUTHORIZATION].retry
    assert POLICY[ErrorClass.PROVIDER_TIMEOUT].may_have_landed
    assert all(POLICY[c].safe_to_retry for c in (ErrorClass.TRANSPORT, ErrorClass.TEMPORARY))


def _c(cls: ErrorClass, code: str = "x") -> Classified:
    return Classified(cls, code)


@pytest.mark.parametrize(
    ("cls", "attempts", "expected"),
    [
        (ErrorClass.TRANSPORT, 1, "retry_wait"),
        (ErrorClass.TRANSPORT, 5, "dead"),
        (ErrorClass.UNKNOWN, 4, "retry_wait"),
        (ErrorClass.UNKNOWN, 5, "dead"),
        (ErrorClass.VALIDATION, 1, "failed"),
        (ErrorClass.AUTHORIZATION, 1, "failed"),
    ],
)
def test_job_outcome__one_table_decides(cls, attempts, expected):
    assert job_outcome(_c(cls), attempts=attempts, max_attempts=5) == expected


@pytest.mark.parametrize(
    ("cls", "attempts", "called", "dedupes", "unsure", "expected"),
    [
        (ErrorClass.TRANSPORT, 1, True, True, False, "pending"),
        (ErrorClass.TRANSPORT, 1, True, True, True, "unknown"),  # an earlier send may have landed
        (ErrorClass.TRANSPORT, 8, True, True, False, "needs_review"),  # budget spent
        (ErrorClass.PROVIDER_TIMEOUT, 1, True, True, False, "unknown"),  # same key next time
        (ErrorClass.PROVIDER_TIMEOUT, 1, True, False, False, "needs_review"),  # e-mail: no keys
        (ErrorClass.PROVIDER_TIMEOUT, 8, True, True, False, "needs_review"),
        (ErrorClass.UNKNOWN, 1, False, False, False, "pending"),  # failed before the call
        (ErrorClass.UNKNOWN, 1, True, False, False, "needs_review"),  # after hand-over, no keys
        (ErrorClass.UNKNOWN, 8, False, True, False, "needs_review"),
        (ErrorClass.VALIDATION, 1, True, True, False, "failed"),
        (ErrorClass.AUTHORIZATION, 1, True, True, False, "withheld"),
    ],
)
def test_effect_outcome__one_table_decides(cls, attempts, called, dedupes, unsure, expected):
    verdict = effect_outcome(
        _c(cls), attempts=attempts, max_attempts=8, called=called, dedupes=dedupes, unsure=unsure
    )
    assert verdict.state == expected
    assert verdict.retry == (expected in ("pending", "unknown"))


def test_effect_outcome__missing_provider_setting_waits_for_an_operator():
    verdict = effect_outcome(
        _c(ErrorClass.VALIDATION, "provider_not_configured"),
        attempts=1,
        max_attempts=8,
        called=False,
        dedupes=True,
        unsure=False,
    )
    assert verdict.state == "needs_review"


def test_backoff_delay__has_floor_cap_and_growing_jittered_window():
    rng = random.Random(7)
    kwargs = {"floor": 1.0, "base": 2.0, "cap": 60.0, "rng": rng}
    samples = {n: [backoff_delay(n, **kwargs) for _ in range(200)] for n in range(1, 9)}
    for n, delays in samples.items():
        window = min(60.0, 2.0 * 2 ** (n - 1))
        assert min(delays) >= 1.0, "never an immediate retry"
        assert max(delays) <= min(60.0, 1.0 + window)
        assert len({round(d, 6) for d in delays}) > 100, "jittered, not a fixed schedule"
    means = [sum(samples[n]) / 200 for n in range(1, 6)]
    assert means == sorted(means), "the window grows with each attempt"


def test_backoff_delay__retry_after_is_a_lower_bound():
    assert backoff_delay(1, floor=0.1, base=0.1, cap=1, retry_after=30, rng=random.Random(1)) == 30


def test_classify__full_or_read_only_storage_is_an_outage_named_by_errno():
    import errno

    c = classify(OSError(errno.ENOSPC, "No space left on device", "/srv/private-name.pdf"))
    assert (c.error_class, c.code, c.outage) == (ErrorClass.TEMPORARY, "storage_enospc", True)
    assert c.detail == "storage unavailable: No space left on device (ENOSPC)"
    assert classify(OSError(errno.EROFS, "x")).code == "storage_erofs"
    assert not classify(OSError(errno.ENOENT, "x")).outage, "a missing file is no outage"


def test_job_outcome__an_outage_waits_by_time_not_by_attempts():
    c = Classified(ErrorClass.TEMPORARY, "storage_enospc", outage=True)
    kwargs = {"attempts": 5, "max_attempts": 5, "outage_window": 3600}
    assert job_outcome(c, outage_for=None, **kwargs) == "outage_wait"
    assert job_outcome(c, outage_for=3599, **kwargs) == "outage_wait"
    assert job_outcome(c, outage_for=3600, **kwargs) == "dead", "past the window it counts"


@pytest.mark.parametrize(
    ("exc", "code", "dependency"),
    [
        (_wrapped(psycopg.errors.AdminShutdown()), "pg_57P01", "database"),
        (_wrapped(psycopg.errors.TooManyConnections()), "pg_53300", "database"),
        (OperationalError("server closed the connection"), "db_unavailable", "database"),
        (OSError(__import__("errno").ENOSPC, "full"), "storage_enospc", "artifact storage"),
        (StorageUnavailable("object storage create failed (EndpointConnectionError)"),
         "storage_unavailable", "artifact storage"),
        (StorageUnavailable("artifact storage write failed (EIO)", code="storage_eio"),
         "storage_eio", "artifact storage"),
        (StorageUnavailable("artifact storage read failed (ESTALE)", code="storage_estale"),
         "storage_estale", "artifact storage"),
    ],
)  # fmt: skip
def test_classify__every_outage_is_one_rule_by_code(exc, code, dependency):
    """A database or an artifact storage that is away: the same outage, whatever failed."""
    c = classify(exc)
    assert (c.error_class, c.code, c.outage) == (ErrorClass.TEMPORARY, code, True)
    assert outage_of(c.code) == dependency
    kwargs = {"attempts": 3, "max_attempts": 3, "outage_window": 3600}
    assert job_outcome(c, outage_for=60, **kwargs) == "outage_wait", "no attempt spent"


def test_classify__a_storage_unavailable_wrapping_an_s3_error_is_an_outage():
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    from jobs.storage_s3 import _unavailable

    for cause in (
        EndpointConnectionError(endpoint_url="http://127.0.0.1:9/bucket"),
        ReadTimeoutError(endpoint_url="http://127.0.0.1:9/bucket"),
        ClientError(
            {"Error": {"Code": "InternalError"}, "ResponseMetadata": {"HTTPStatusCode": 500}},
            "PutObject",
        ),
        ClientError({"Error": {}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject"),
    ):
        try:
            try:
                raise cause
            except Exception as exc:
                raise _unavailable(exc, "create") from exc
        except StorageUnavailable as wrapped:
            c = classify(wrapped)
        assert (c.code, c.outage) == ("storage_unavailable", True), cause
        assert "127.0.0.1" not in c.detail and "bucket" not in c.detail, c.detail


def test_classify__other_temporary_failures_are_no_outage():
    assert not classify(TemporaryFailure("down")).outage, "budgeted by attempts"
    assert not classify(_status_error(503)).outage, "a provider's 503 is its circuit's"
    assert not classify(_wrapped(psycopg.errors.DeadlockDetected())).outage
    assert not classify(PayloadInvalid("x", code="storage_x")).outage, "permanent: no wait"


# --- a redacting kind keeps class and code only (issue 32, item 5) ----------------------


@pytest.mark.parametrize(
    "exc",
    [
        PayloadInvalid("no permit for Zelda Quartermaine +1 555 0199"),
        NotAuthorized("withdrawn by zelda.q@example.net"),
        TemporaryFailure("pool busy for XQ-4417-2209", retry_after=3.0),
        OSError(28, "No space left on device"),  # the engine's own words
        OperationalError("connection to server lost"),
    ],
    ids=["payload_invalid", "not_authorized", "temporary", "enospc", "db_unavailable"],
)
def test_classify__a_redacting_kind_keeps_no_detail_of_any_exception(exc):
    kept = classify(exc)
    redacted = classify(exc, redact=True)
    assert kept.detail, "without redaction the detail is kept (the check can fail)"
    assert redacted.detail == ""
    assert (redacted.error_class, redacted.code, redacted.retry_after, redacted.outage) == (
        kept.error_class,
        kept.code,
        kept.retry_after,
        kept.outage,
    ), "the class, the code and what the table does with them are unchanged"


def test_classify__a_redacting_predicate_decides_per_exception():
    def only_payloads(exc: BaseException) -> bool:
        return isinstance(exc, PayloadInvalid)

    assert classify(PayloadInvalid("secret"), redact=only_payloads).detail == ""
    assert classify(NotAuthorized("withdrawn"), redact=only_payloads).detail == "withdrawn"

    def broken(exc: BaseException) -> bool:
        raise RuntimeError("a broken predicate must not leak")

    assert classify(PayloadInvalid("secret"), redact=broken).detail == ""
