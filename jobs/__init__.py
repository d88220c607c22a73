"""A reusable Django app for background jobs with one outcome per job.

The public API is re-exported here and loaded on first use, so ``import jobs``
is safe before Django's apps are ready (in settings, in ``jobkinds.py``)::

    import jobs

    @jobs.kind("billing.invoice", max_attempts=5)
    def invoice(ctx: jobs.JobContext) -> list[jobs.EffectSpec]: ...

    @jobs.kind("billing.reminder")  # async def: its own event loop per delivery
    async def reminder(ctx: jobs.AsyncJobContext) -> list[jobs.EffectSpec]: ...

    handle = jobs.request("billing.invoice", order, revision=1, params={"user_id": 7})

It imports nothing from the project; kinds and providers register themselves
through ``jobs.registry``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# name -> module that defines it
_EXPORTS = {
    "kind": "jobs.api",
    "cancel": "jobs.api",
    "request": "jobs.api",
    "request_many": "jobs.api",
    "then": "jobs.chains",
    "q_cluster": "jobs.cluster",
    "group": "jobs.chains",
    "result": "jobs.chains",
    "JobRequest": "jobs.api",
    "JobHandle": "jobs.api",
    "JobFailure": "jobs.api",
    "JobProgress": "jobs.api",
    "JobConflict": "jobs.api",
    "EffectSpec": "jobs.registry",
    "register_kind": "jobs.registry",
    "register_provider": "jobs.registry",
    "register_subject": "jobs.hooks",
    "JobContext": "jobs.delivery.runner",
    "AsyncJobContext": "jobs.asyncctx",
    "Provider": "jobs.providers",
    "JobError": "jobs.exceptions",
    "PayloadInvalid": "jobs.exceptions",
    "NotAuthorized": "jobs.exceptions",
    "TemporaryFailure": "jobs.exceptions",
    "LeaseLost": "jobs.exceptions",
    "JobCancelled": "jobs.exceptions",
    "JobTimeout": "jobs.exceptions",
}
__all__ = [
    "AsyncJobContext",
    "EffectSpec",
    "JobCancelled",
    "JobConflict",
    "JobContext",
    "JobError",
    "JobFailure",
    "JobHandle",
    "JobProgress",
    "JobRequest",
    "JobTimeout",
    "LeaseLost",
    "NotAuthorized",
    "PayloadInvalid",
    "Provider",
    "TemporaryFailure",
    "cancel",
    "group",
    "kind",
    "q_cluster",
    "register_kind",
    "register_provider",
    "register_subject",
    "request",
    "request_many",
    "result",
    "then",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from jobs.api import (
        JobConflict,
        JobFailure,
        JobHandle,
        JobProgress,
        JobRequest,
        cancel,
        kind,
        request,
        request_many,
    )
    from jobs.asyncctx import AsyncJobContext
    from jobs.chains import group, result, then
    from jobs.cluster import q_cluster
    from jobs.delivery.runner import JobContext
    from jobs.exceptions import (
        JobCancelled,
        JobError,
        JobTimeout,
        LeaseLost,
        NotAuthorized,
        PayloadInvalid,
        TemporaryFailure,
    )
    from jobs.hooks import register_subject
    from jobs.providers import Provider
    from jobs.registry import EffectSpec, register_kind, register_provider


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jobs' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
