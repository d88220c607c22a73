"""Kinds declared the way a project would: ``@jobs.kind`` in ``jobkinds.py`` (autodiscovered)."""

from __future__ import annotations

import jobs


@jobs.kind("test.declared", max_attempts=2)
def declared(ctx: jobs.JobContext) -> list[jobs.EffectSpec]:
    """Store a small artifact, notify ``params.recipient`` (whatever form the test gives)."""
    ctx.check_owner()
    ctx.store_artifact(f"job {ctx.job.pk}\n".encode(), content_type="text/plain", extension="txt")
    return [jobs.EffectSpec("done-notice", "inapp", ctx.params["recipient"], {"title": "done"})]
