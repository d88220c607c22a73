"""The testing page's example kind (docs/app/testing.md includes this file).

In a project it would be ``shop/jobkinds.py``; here the example tests import it.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model

import jobs


@jobs.kind("shop.welcome", max_attempts=3)
def welcome(ctx: jobs.JobContext) -> list[jobs.EffectSpec]:
    """Write a welcome letter for a new user and mail them that it is ready, once."""
    users = ctx.read(get_user_model().objects.filter(pk=ctx.params["user_id"]))  # fenced read
    if not users:
        raise jobs.PayloadInvalid("params.user_id names no user")
    letter = f"Welcome, {users[0].get_username()}!\n".encode()
    ctx.store_artifact(letter, content_type="text/plain", extension="txt")
    return [jobs.EffectSpec("welcome-mail", "email", str(users[0].pk))]
