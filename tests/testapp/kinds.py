"""A job kind whose behaviour the test chooses through params (ids and flags only)."""

from __future__ import annotations

import time

from jobs.delivery.runner import JobContext
from jobs.exceptions import NotAuthorized, PayloadInvalid, TemporaryFailure
from jobs.registry import EffectSpec, register_kind


def _error(mode: str) -> Exception:
    if mode == "temporary":
        return TemporaryFailure("test dependency unavailable", code="test_unavailable")
    if mode == "validation":
        return PayloadInvalid("params.fail asked for a validation error")
    if mode == "authorization":
        return NotAuthorized("test policy refused the read")
    return RuntimeError("test asked for an unexpected error")


def steps(ctx: JobContext) -> list[EffectSpec]:
    """Fail on chosen attempts, work in heartbeated stages, store an artifact, notify."""
    p = ctx.params
    if not isinstance(p.get("recipients", []), list):
        raise PayloadInvalid("params.recipients must be a list of user ids")
    fail = p.get("fail", {})
    mode = fail.get(str(ctx.job.attempts)) or fail.get("always")
    if mode:
        raise _error(mode)
    ctx.check_owner()
    for _ in range(int(p.get("stages", 0))):
        time.sleep(float(p.get("stage_sleep", 0)))
        ctx.heartbeat()
    body = f"artifact of job {ctx.job.pk} revision {ctx.job.output_revision}\n".encode()
    ctx.store_artifact(body, content_type="text/plain", extension="txt")
    for _ in range(int(p.get("after_stages", 0))):
        time.sleep(float(p.get("stage_sleep", 0)))
        ctx.heartbeat()
    return [
        EffectSpec("completion-notice", "inapp", str(r), {"title": f"job {ctx.job.pk} done"})
        for r in p.get("recipients", [])
    ]


def register() -> None:
    register_kind("test.steps", steps)
    register_kind("test.short", steps, max_attempts=3)
    register_effect_kinds()


def notify(ctx: JobContext) -> list[EffectSpec]:
    """Store a small artifact; notify ``params.recipient`` through each of ``params.providers``."""
    ctx.check_owner()
    ctx.store_artifact(b"notify", content_type="text/plain", extension="txt")
    recipient = str(ctx.params["recipient"])
    return [
        EffectSpec(f"notice-{name}", name, recipient, {"report_key": f"job-{ctx.job.pk}"})
        for name in ctx.params.get("providers", ["inapp"])
    ]


def _release_check_raises(effect) -> str | None:
    raise RuntimeError("the release policy service is unavailable")


def register_effect_kinds() -> None:
    register_kind("test.release_check_raises", notify, authorize_release=_release_check_raises)
    register_kind("test.notify_only", notify)
