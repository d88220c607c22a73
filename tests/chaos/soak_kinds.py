"""The soak's own kinds: two periodic ones and a chain (a group of parts and its join).

Installed as an app by the soak's settings only (``tests.chaos.soak_settings``), so the
scale-out drill, which shares the soak's timers (``tests.chaos.settings``), gets no
ticks it does not check. They run in the same queue as the reports, so the chaos's
kills and the database outage land on them too; ``tests.chaos.checker`` holds them to
their promises (one job per tick and the catch-up policy; one group per parent, each
child counted once, one join that saw every child's result).

- ``soak.tick`` every 5 s, ``catch_up="all"``: each tick missed while the database was
  away must get its own job once it is back (none lost).
- ``soak.digest`` every 3 s, ``catch_up="latest"``: of the ticks missed then, only the
  newest gets a job. 3 s so that the soak's 7 s outage always spans two of its ticks
  and the skip really happens.
- ``soak.chain`` returns ``jobs.group`` of ``params.parts`` ``soak.part`` children
  (heartbeated work, a ``jobs.result`` derived from their params) and a ``soak.join``
  that records what ``ctx.joined()`` showed it; its rule is ``run``, so a join runs
  (and is compared) even when kills spent a part's budget.
- ``soak.debounced`` (issue 42) is debounced (1 s window, 4 s at most): the soak asks
  for each of a few keys in bursts of requests 0.15 s apart; each job must run once,
  with the params of the last request that reached it, and count the others it replaced.

None of them stores an artifact or asks for an effect: the checker expects none.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from django.apps import AppConfig

TICK, DIGEST = "soak.tick", "soak.digest"
PERIODIC = {TICK: ("all", 5), DIGEST: ("latest", 3)}  # kind -> (catch_up, seconds)
CHAIN, PART, JOIN = "soak.chain", "soak.part", "soak.join"
CHAIN_SUBJECT = "soak.chain"
GROUP_NAME = "parts"
# Every kind here; the engine makes the jobs of these (ticks, parts, joins), not the soak.
DEBOUNCED, DEBOUNCE_SUBJECT = "soak.debounced", "soak.debounce"
DEBOUNCE_SECONDS, DEBOUNCE_MAX_SECONDS = 1.0, 4.0
KINDS = (TICK, DIGEST, CHAIN, PART, JOIN, DEBOUNCED)
ENGINE_MADE = (TICK, DIGEST, PART, JOIN)
PART_SLICES, PART_SLICE_SECONDS = 5, 0.2  # about 1 s of work: kills land in it


def part_value(chain: int, part: int) -> int:
    """What part ``part`` of chain ``chain`` computes: the checker derives it too."""
    return (chain + 1) * 100 + part


def periodic(ctx: Any) -> list:
    """One tick: fenced (check_owner), then its own result, naming the tick it ran for."""
    import jobs

    ctx.check_owner()
    return [jobs.result({"tick": ctx.job.subject_id})]


def chain(ctx: Any) -> list:
    """A group of ``params.parts`` parts and a join, written by this job's publish."""
    import jobs

    ctx.check_owner()
    p = ctx.params
    parts = [
        jobs.then(PART, params={"chain": p["chain"], "part": n}, name=f"p{n}")
        for n in range(p["parts"])
    ]
    join = jobs.then(JOIN, params={"chain": p["chain"], "parts": p["parts"]})
    return [jobs.group(parts, join=join, name=GROUP_NAME)]


def part(ctx: Any) -> list:
    """A little work in heartbeated slices (a SIGKILL lands mid-work), then its result."""
    import jobs

    ctx.check_owner()
    for _ in range(PART_SLICES):
        time.sleep(PART_SLICE_SECONDS)
        ctx.heartbeat()
    p = ctx.params
    return [jobs.result({"part": p["part"], "value": part_value(p["chain"], p["part"])})]


def join(ctx: Any) -> list:
    """Records each child as ``ctx.joined()`` showed it: name, job, end, result."""
    import jobs

    ctx.check_owner()
    seen = [[c.name, c.job_id, c.state, c.result] for c in ctx.joined()]
    total = sum(c.result["value"] for c in ctx.joined() if c.result)
    return [jobs.result({"seen": seen, "total": total})]


def debounced(ctx: Any) -> list:
    """Fenced, then its own result: the request (``seq``) whose params it ran with."""
    import jobs

    ctx.check_owner()
    return [jobs.result({"seq": ctx.params["seq"]})]


def register() -> None:
    """Register the soak's kinds (idempotent)."""
    from jobs.registry import register_kind

    for name, (catch_up, seconds) in PERIODIC.items():
        register_kind(name, periodic, schedule=timedelta(seconds=seconds), catch_up=catch_up)
    register_kind(CHAIN, chain)
    register_kind(PART, part)
    register_kind(JOIN, join, on_child_failure="run")
    register_kind(
        DEBOUNCED, debounced, debounce=DEBOUNCE_SECONDS, debounce_max=DEBOUNCE_MAX_SECONDS
    )


class SoakKindsConfig(AppConfig):
    """The soak's kinds as an app of their own (only the soak's settings install it)."""

    name = "tests.chaos.soak_kinds"
    label = "soak_kinds"
    verbose_name = "Soak kinds"

    def ready(self) -> None:
        register()
