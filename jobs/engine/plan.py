"""What travels between the engine, the executors and the delivery: frozen or plain
records with no behaviour of their own, so no executor imports its caller.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, JobGroup, JobStep, Notice


@dataclass
class Claim:
    """What a delivery found: ``claimed`` (work to do) or why there is none."""

    status: str  # claimed | duplicate | deferred | buried | cancelled | missing | passed
    job: Job | None = None
    attempt: Attempt | None = None
    # deferred: what held the job back (counted on the job, ``held_looks``: no attempt row)
    hold: Hold | None = None

    @property
    def won(self) -> bool:
        return self.status == "claimed"


@dataclass(frozen=True)
class Hold:
    """Why work may not start now, and in how many seconds (server clock) to try again."""

    scope: str
    reason: str  # paused | concurrency | rate | busy | circuit_open | tenant_bound
    delay: float

    @property
    def code(self) -> str:
        # The plain tenant bound (no flow rule) is recorded without a code, as always.
        return {"rate": "rate_limited", "circuit_open": "circuit_open", "tenant_bound": ""}.get(
            self.reason, f"flow_{self.reason}"
        )


@dataclass(frozen=True)
class Plan:
    """Everything one publish writes, decided before anything is written."""

    job: Job
    worker: str
    attempt: Attempt
    margin: float  # seconds of lease that must be left when the fence is checked
    changes: tuple[tuple[str, Any], ...]  # the job's columns (``job_machine.publish_changes``)
    artifact: Artifact | None
    effects: tuple[Effect, ...]  # unsaved, in their born state
    notices: tuple[tuple[str, Notice], ...]  # (effect_id, unsaved in-app notice)
    events: tuple[tuple[str, EffectEvent], ...]  # (effect_id, unsaved event)
    accounts: tuple[str, ...]  # recipients of applied notices: the release rule checks them
    applies: tuple[str, ...]  # effect_ids a transactional provider applies (its own code)
    enqueues: tuple[str, ...]  # effect_ids that leave with a queue message
    # Follow-up work (``jobs.engine.groups``): unsaved jobs, and groups with their children.
    follow_ups: tuple[Job, ...] = ()
    groups: tuple[tuple[JobGroup, tuple[Job, ...]], ...] = ()
    # Durable steps this attempt finished and has not recorded: they commit with it.
    steps: tuple[JobStep, ...] = ()

    def statement_refusal(self) -> str:
        """Why the one-statement executor cannot take this plan ("" if it can)."""
        if self.applies:
            return "a transactional provider's own apply"
        if self.follow_ups or self.groups:
            return "follow-up jobs"
        if self.job.group_id is not None:
            return "a group's child: its end is counted in the group"
        if any(name == "result" for name, _ in self.changes):
            return "a result value"
        return ""


class Status(enum.Enum):
    WON = "won"  # the job is succeeded; everything in the plan committed with it
    LOST = "lost"  # the fence failed: another worker owns the job; nothing was written
    ACCOUNTS_REFUSED = "accounts_refused"  # nothing written: build again without them


@dataclass
class Result:
    status: Status
    executor: str
    refused: dict[str, str] = field(default_factory=dict)  # recipient → withhold reason
    effects: list[Effect] = field(default_factory=list)
    # The publish looked at its job's sequence itself and released the next job if this
    # one let it start: nobody needs to look again after it (``sequences.moved``).
    sequence_looked: bool = False
