"""Job kinds this site registers with the engine.

``permits.report`` is the permit review report (``permits.reports``).
``permits.assigned-notice`` and ``permits.report-stopped-notice`` are the reviewers'
notices of events (``permits.notices``); ``permits.morning-digest`` is the periodic one
(``permits.digest``); ``permits.decision`` → ``permits.decision-letter`` is the
chain after a reviewer's decision, its letter on the ``heavy`` queue (``permits.letters``).
``demo.summary`` is a minimal kind (a small
text artifact and one in-app notice) used by the burst and benchmarks to measure the
engine itself.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model

from jobs.delivery.runner import JobContext
from jobs.exceptions import PayloadInvalid
from jobs.ops.words import set_provider_words
from jobs.registry import EffectSpec, register_kind


def demo_summary(ctx: JobContext) -> list[EffectSpec]:
    job = ctx.job
    recipient = job.params.get("notify_user_id")
    if not isinstance(recipient, int):
        raise PayloadInvalid("params.notify_user_id must be an integer user id")
    # The user is read only while this worker still holds the job (one statement).
    if not ctx.read(get_user_model().objects.filter(pk=recipient)):
        raise PayloadInvalid("params.notify_user_id names no user")
    ctx.heartbeat()
    body = (
        f"Summary for {job.subject_type} {job.subject_id}, revision {job.output_revision}\n"
        f"Generated for job {job.pk} at {job.created_at.isoformat()}\n"
    ).encode()
    ctx.store_artifact(body, content_type="text/plain", extension="txt")
    return [
        EffectSpec(
            name="completion-notice",
            provider="inapp",
            recipient=str(recipient),
            data={"title": f"Summary ready: job {job.pk} revision {job.output_revision}"},
        )
    ]


def register() -> None:
    from permits import digest, drill, letters, notices, reports

    register_kind("demo.summary", demo_summary)
    reports.register(notices.telling_when_stopped(reports.build_report))
    notices.register()
    digest.register()
    letters.register()
    drill.register()
    # The webhook carries notices to the reviewer's device: that is its name on both
    # sides (the reviewer's "Notice to your device", the admin's "Device · webhook").
    set_provider_words("webhook", "Device", "device")
