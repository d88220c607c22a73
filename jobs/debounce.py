"""Debounce, latest wins: requests close together make one job, with the last one's params.

A debounced kind (``@jobs.kind(debounce=1, debounce_max=5)``) groups its requests by a
key (the kind and the subject, or the kind's ``debounce_key``). The first request of a
key opens a window: a job due ``debounce`` seconds later. Until that job's first claim,
each request under the key replaces its params, counts one more in
``Job.debounce_replaced`` and pushes its due time to ``debounce`` seconds after itself,
never past ``debounce_max`` after the window's first request (``Job.debounce_until``).
Once claimed, the job is closed to replacements, and the key's next request opens a new
window: a new job (docs/app/debounce.md).

Safe across processes, on the ORM alone (PostgreSQL and SQLite):

- one open window per key: a unique partial index (``jobs_job_one_open_debounce_window``
  on ``debounce_key`` where ``models.DEBOUNCE_OPEN``). Two requests that both found no
  window both insert; the second waits for the first's commit and fails, and looks again;
- a replacement locks the window's row (``SELECT ... FOR UPDATE``, waiting its turn: the
  requests of one key line up, so the last to commit is the one whose params stay) and
  writes it by compare-and-swap on its version, only while the window is still open. The
  claim locks the row too (``FOR UPDATE SKIP LOCKED``) and moves it out of the window in
  its own CAS: a replacement waiting for the claim's lock finds the window closed and
  opens a new one; a claim meeting a replacement's lock passes the job over, and takes it
  with the latest params at its next look. On SQLite the write lock a transaction takes
  at its start (``BEGIN IMMEDIATE``) does the same.
- identity wins: a request for a (kind, subject, revision) whose job exists and is closed
  gets that job, as for any kind.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Literal

from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce, Greatest, Least

from jobs import clock
from jobs.engine.cas import compare_and_swap
from jobs.exceptions import JobError
from jobs.models import DEBOUNCE_OPEN, Job
from jobs.queue import enqueue_jobs
from jobs.registry import JobKind

log = logging.getLogger("jobs.debounce")

Landed = Literal["created", "replaced", "existing"]
KEY_MAX = 200  # Job.debounce_key's length: a longer key is stored as its hash
# Looks again after a concurrent request won a race (an insert under the unique index, an
# identity taken meanwhile); each race means another request made progress.
RACES = 8
# Open: never claimed, still queued (``DEBOUNCE_OPEN``), and under a debounce key.
_OPEN = DEBOUNCE_OPEN & ~Q(debounce_key="")


def window_key(job_kind: JobKind, params: dict, subject: tuple[str, str]) -> str:
    """The key of the window a request joins: its subject's, or the kind's ``debounce_key``
    of (params, subject), always under the kind's name (two kinds never share a window)."""
    if job_kind.debounce_key is None:
        own = f"{subject[0]}:{subject[1]}"
    else:
        own = job_kind.debounce_key(dict(params), subject)
        if not isinstance(own, str) or not own:
            raise ValueError(f"{job_kind.name}: debounce_key must return a non-empty string")
    key = f"{job_kind.name}:{own}"
    if len(key) > KEY_MAX:
        key = f"{job_kind.name}:#{hashlib.sha256(own.encode()).hexdigest()}"
    return key


def obtain(
    job_kind: JobKind, identity: dict[str, Any], params: dict, defaults: dict[str, Any]
) -> tuple[Job, Landed]:
    """The job a debounced request lands on, and how: ``created`` (it opened a window),
    ``replaced`` (its params replaced an open window's) or ``existing`` (its identity's
    job is closed: that job, unchanged). ``identity``: kind, subject and revision;
    ``defaults``: the rest of a new row (tenant, budget, priority, queue, times)."""
    subject = (identity["subject_type"], identity["subject_id"])
    key = window_key(job_kind, params, subject)
    for _ in range(RACES):
        try:
            with transaction.atomic():
                landed = _land(job_kind, key, identity, params, defaults)
        except IntegrityError:
            continue  # another request opened this window or took this identity: look again
        if landed is not None:
            return landed
    raise JobError(f"debounce: the window {key!r} kept meeting concurrent requests; ask again")


def _land(
    job_kind: JobKind,
    key: str,
    identity: dict[str, Any],
    params: dict,
    defaults: dict[str, Any],
) -> tuple[Job, Landed] | None:
    """One look, in one transaction: the identity's job, else the key's open window, else a
    new window. None when a CAS lost (look again)."""
    locked = Job.objects.select_for_update()  # waits its turn: a claim's, a replacement's
    own = locked.filter(_OPEN, **identity).first()
    if own is not None:  # the identity's own window is open: replaced
        return (own, "replaced") if _replace(job_kind, own, params, {}) else None
    # Read as closed: a window another request opened since the look above is open, and
    # is found below (its key's) or by the next look (another key's).
    closed = Job.objects.filter(**identity).exclude(_OPEN).first()
    if closed is not None:  # claimed or finished: identity wins, as for every kind
        return closed, "existing"
    window = locked.filter(_OPEN, debounce_key=key).first()
    if window is not None:
        # Latest wins whole: the window's job becomes this request (subject, revision and
        # params); it never ran, so nothing derived from its identity exists yet.
        moved = {name: value for name, value in identity.items() if name != "kind"}
        return (window, "replaced") if _replace(job_kind, window, params, moved) else None
    job = Job.objects.create(
        **identity,
        **defaults,
        params=params,
        debounce_key=key,
        next_attempt_at=clock.after(job_kind.debounce or 0),
        debounce_until=clock.after(job_kind.debounce_max or 0),
    )
    job.refresh_from_db(fields=["next_attempt_at", "debounce_until"])  # the server's clock
    enqueue_jobs([job], due_now=False)  # an idle cluster learns the window's due time
    return job, "created"


def _replace(job_kind: JobKind, job: Job, params: dict, moved: dict[str, Any]) -> bool:
    """Replace an open window's params (and, from another identity, its subject and
    revision); push its due time. False when the window is closed (claimed meanwhile)."""
    pushed = Least(clock.after(job_kind.debounce or 0), F("debounce_until"))
    won = compare_and_swap(
        job,
        where=_OPEN,
        params=params,
        debounce_replaced=F("debounce_replaced") + 1,
        # Never earlier than it was (a flow rule's deferral may have pushed it further).
        next_attempt_at=Greatest(Coalesce(F("next_attempt_at"), pushed), pushed),
        **moved,
    )
    if won:
        job.refresh_from_db(fields=["next_attempt_at", "debounce_replaced"])
        log.info(
            "job=%s kind=%s arrow=debounce replaced=%s",
            job.pk,
            job.kind,
            job.debounce_replaced,
        )
    return won
