"""Errors raised by the jobs app.

Messages are written by this code, never copied from payloads, so they may be
stored in error fields and logged.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class JobError(Exception):
    """Base class for errors raised by the jobs app."""

    error_class: str | None = None
    code = "job_error"

    def __init__(self, detail: str = "", *, code: str | None = None):
        super().__init__(detail or (self.__doc__ or "").strip())
        if code:
            self.code = code

    @property
    def detail(self) -> str:
        return str(self)


class JobConflict(JobError, ValueError):
    """Raised when a job with this identity exists and was asked for with other params."""

    error_class = "validation"
    code = "identity_conflict"

    @classmethod
    def of(cls, job, stored: dict) -> JobConflict:
        """``job`` exists and was asked for with ``stored``: which keys differ, not values."""
        gone = object()
        keys = sorted(
            k for k in {*job.params, *stored} if job.params.get(k, gone) != stored.get(k, gone)
        )
        return cls(
            f"job {job.pk} ({job.kind} {job.subject_type}:{job.subject_id} revision "
            f"{job.output_revision}) exists with other params (keys differing: "
            f"{', '.join(keys) or '-'}); ask for a new revision to get a new output"
        )


class LeaseLost(JobError):
    """Raised when another worker reclaimed the job while this one still ran."""

    code = "lease_lost"


class JobCancelled(LeaseLost):
    """Raised in a running handler when a cancel was asked for: it stops, publishes nothing."""

    code = "cancelled"


class PayloadInvalid(JobError):
    """Raised when a job's parameters are malformed; retrying cannot help."""

    error_class = "validation"
    code = "payload_invalid"


class NotAuthorized(JobError):
    """Raised when current policy no longer allows the job to read or release data."""

    error_class = "authorization"
    code = "not_authorized"


class TemporaryFailure(JobError):
    """Raised when a dependency is temporarily unavailable; retry later."""

    error_class = "temporary"
    code = "temporary"

    def __init__(
        self, detail: str = "", *, code: str | None = None, retry_after: float | None = None
    ):
        super().__init__(detail, code=code)
        self.retry_after = retry_after


class JobTimeout(TemporaryFailure):
    """Raised in a handler that ran past its kind's ``timeout``: the attempt is retried."""

    code = "timeout"


class StorageUnavailable(TemporaryFailure):
    """Raised when the artifact storage cannot be read or reached now; retry later.

    Not a verdict on the bytes: a verified read that meets it answers "try again" and
    asks for no restore (a missing or mismatching file is ``ArtifactCorrupt``)."""

    code = "storage_unavailable"


class UnknownKind(JobError):
    """Raised when a job names a kind that no app registered."""

    error_class = "validation"
    code = "unknown_kind"


class ArtifactCorrupt(JobError):
    """Raised when an artifact's stored bytes are missing or do not match its row's sha256."""

    code = "artifact_corrupt"


class ArtifactLost(ArtifactCorrupt):
    """Raised when an artifact is marked lost: its published bytes cannot be produced again."""

    code = "artifact_lost"


class DeliveryFailed(JobError):
    """Raised to django-q2 when a delivery ended without an outcome (it is redelivered)."""

    code = "delivery_failed"


# --- providers: the class decides the retry (``jobs.retry``) ----------------------------


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


class ProviderLookupUnsupported(ProviderError):
    """Raised when the provider answered that it cannot look a key up (HTTP 405/501)."""

    error_class = "unknown"
    code = "lookup_unsupported"


class ProviderProtocolError(ProviderError):
    """Raised when the provider answered outside its protocol (e.g. no id)."""

    error_class = "unknown"
    code = "protocol_error"
