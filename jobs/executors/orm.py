"""The ORM executor: the whole contract in Django's ORM (SQLite, psycopg2, any database).

Every arrow here is the engine's own, spoken in the ORM: the claim of a named job
(``jobs.engine.named_claim``: exactly that job; ``jobs.engine.verdict`` decides and
records what the delivery was), the owner fence (``job_machine``) and the publish of a
frozen ``Plan`` in one worker transaction (``jobs.engine.publishing``). The
PostgreSQL executor gives way to the same engine code for the refusals it documents;
it never imports this module.
"""

from __future__ import annotations

from django.db.models import Exists

from jobs import clock
from jobs.engine import job_machine
from jobs.engine.named_claim import claim
from jobs.engine.publishing import EXECUTOR as name
from jobs.engine.publishing import publish, refused_accounts
from jobs.models import Attempt, Job

__all__ = [
    "claim",
    "held_while",
    "name",
    "publish",
    "read_claim",
    "refused_accounts",
    "still_owner",
]


def read_claim(job_id: int, attempt_id: int) -> Attempt | None:
    """The attempt a claim started, with its job and the server's clock, in one read."""
    found = Attempt.objects.select_related("job").annotate(db_now=clock.ServerNow())
    return found.filter(pk=attempt_id, job_id=job_id).first()


def still_owner(job: Job, worker: str) -> bool:
    """Whether ``worker`` holds ``job`` at the version it last wrote, on a live lease."""
    return job_machine.still_owner(job, worker)


def held_while(job: Job, worker: str) -> Exists:
    """``still_owner`` as a condition of another query."""
    return Exists(job_machine.owner_holds(job, worker))
