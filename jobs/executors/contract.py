"""What every executor does: the database-specific half of the engine, whole.

An executor carries out the arrows whose fast form differs per database: the claim
(``queued``/due ``retry_wait``/expired ``running`` → ``running``, with its attempt row,
or the record of why not), the owner check before each private read, and the publish
of a frozen ``Plan``. Each is complete on its own: the PostgreSQL executor gives way
to the ORM's only for the refusals it documents, and then the same admission runs.
``tests/jobs/test_executor_contract.py`` runs every scenario on each and compares
every row written.
"""

from __future__ import annotations

from typing import Protocol

from django.db.models import Expression

from jobs.engine.plan import Claim, Plan, Result
from jobs.models import Attempt, Job


class Executor(Protocol):
    name: str

    def claim(self, job_id: int, worker: str, *, lease: float, bound: int) -> Claim:
        """Take the job for ``worker`` or record why not (duplicate, deferred, buried)."""

    def read_claim(self, job_id: int, attempt_id: int) -> Attempt | None:
        """The attempt a claim started, its ``job`` and the server's clock (``db_now``) in
        one read: how a worker adopts the claim its cluster made for it."""

    def still_owner(self, job: Job, worker: str) -> bool:
        """Whether ``worker`` holds ``job`` at the version it last wrote, on a live lease."""

    def held_while(self, job: Job, worker: str) -> Expression:
        """The same fence as a condition of another query (``JobContext.read``): true while
        ``worker`` holds ``job``, so a private read and its check are one statement."""

    def publish(self, plan: Plan) -> Result:
        """running → succeeded with everything in ``plan``, or nothing (LOST / refused)."""
