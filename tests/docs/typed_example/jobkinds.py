"""The kinds page's typed example (docs/app/kinds.md includes this file; mypy checks it).

In a project it would be ``billing/jobkinds.py``; here its test imports it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TypedDict

from django.contrib.auth import get_user_model

import jobs


@dataclasses.dataclass(frozen=True)
class Totals:
    users: int
    active: int


class Counted(TypedDict):
    rows: int


@jobs.kind("billing.totals")
def totals(ctx: jobs.JobContext) -> Totals:
    """Count the users the job may read (fenced): the result is the job's JSON result."""
    found = ctx.read(get_user_model().objects.filter(pk__in=ctx.params["user_ids"]))
    return Totals(users=len(found), active=sum(1 for user in found if user.is_active))


@jobs.kind("billing.count", timeout=30)
async def count(ctx: jobs.AsyncJobContext) -> Counted:
    """The same in an ``async def``: awaitable context calls, a TypedDict result."""
    found = await ctx.aread(get_user_model().objects.filter(pk__in=ctx.params["user_ids"]))
    await asyncio.sleep(0)
    return Counted(rows=len(found))
