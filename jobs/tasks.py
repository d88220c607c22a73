"""django-q2 entry points. Packages carry only ids: nothing private in the queue.

The jobs table is the queue (``jobs.claiming``): the broker claims a job and hands the
worker a package naming it and its fence (``run_claimed``), or leases an effect for
sending (``release_claimed``); there is no message to acknowledge, the outcome's commit
is the acknowledgement. Each delivery runs inside ``supervisor.delivery``: it marks
progress for ``manage.py jobs_worker`` and reports a failure that escaped the engine
(e.g. the database refused a write) by class and code only.

``run_job`` and ``release_effect`` deliver a job or an effect named by id: what
django-q2's ``sync`` runs in the caller's process (``jobs.queue.enqueue_jobs``), and a
message left in ``django_q_ormq`` by a version that still sent them, which the claiming
broker hands out as any plain task (the named claim: exactly that job, or nothing).
"""

from __future__ import annotations

import time

from jobs import backends, dispatch, queue
from jobs.delivery import release, runner
from jobs.engine.job_machine import worker_identity
from jobs.exceptions import DeliveryFailed
from jobs.models import Effect
from jobs.supervisor import delivery


def run_job(job_id: int, due: str | None = None) -> str:
    """One delivery of the job ``job_id`` (claimed here, by name); returns after every
    outcome is committed. ``due``: ignored (messages of older versions carried it)."""
    with delivery("run_job", job_id):
        result = runner.run_delivery(job_id)
        # A django.tasks task that this delivery finished: task_finished, now it is committed.
        backends.announce_finished(result.job_id, result.outcome)
        return result.outcome


def run_claimed(
    job_id: int, owner: str, attempt_id: int, version: int, queues: list[str] | None = None
) -> str:
    """Run the job the broker claimed for this worker (``jobs.claiming``): the worker
    adopts the claim's owner and attempt, it does not claim again. Nothing to
    acknowledge: the outcome's commit is the job's acknowledgement. Then, while its
    queues have due work, the worker claims and runs their next jobs itself
    (``jobs.claiming.keep_going``)."""
    from jobs import claiming

    started = time.monotonic()
    with queue.claiming_next(queues or []):
        with delivery("run_job", job_id):
            result = runner.run_adopted(job_id, owner, attempt_id, version)
            backends.announce_finished(result.job_id, result.outcome)
        claiming.keep_going(queues or [], owner, started=started, run=_run_claim)
    return result.outcome


def release_claimed(effect_pk: int, owner: str, prior: str, queues: list[str] | None = None) -> str:
    """Send the effect the broker leased for this worker (``jobs.claiming``): the lease is
    adopted (one read), not taken again; then, as ``run_claimed``, the worker keeps
    claiming while its queues have due work."""
    from jobs import claiming

    started = time.monotonic()
    with queue.claiming_next(queues or []):
        with delivery("release_effect", effect_pk):
            outcome = _send_leased(effect_pk, owner, prior)
        claiming.keep_going(queues or [], owner, started=started, run=_run_claim)
    return outcome


def _send_leased(effect_pk: int, owner: str, prior: str) -> str:
    effect = Effect.objects.select_related("job").filter(pk=effect_pk).first()
    if effect is None:
        return "missing"
    if effect.state != Effect.State.SENDING or effect.lease_owner != owner:
        return "stale"  # its lease ran out and another sender took it, or an operator acted
    return release.send_claimed(effect, owner, prior)


def _run_claim(claim) -> bool:
    """Run a job or send an effect this worker claimed itself; False when its delivery
    failed outside the engine (the lease runs out and it is claimed again)."""
    from jobs.claiming import Leased

    try:
        if isinstance(claim, Leased):
            with delivery("release_effect", claim.effect.pk):
                _send_leased(claim.effect.pk, claim.effect.lease_owner, claim.prior)
            return True
        with delivery("run_job", claim.job.pk):
            result = runner.run_claim(claim, claim.job.lease_owner)
            backends.announce_finished(result.job_id, result.outcome)
    except DeliveryFailed:
        return False
    return True


def release_effect(effect_pk: int) -> str:
    """Release one effect named by id (``sync``, or a message of an older version)."""
    with delivery("release_effect", effect_pk):
        effect = Effect.objects.select_related("job").filter(pk=effect_pk).first()
        if effect is None:
            return "missing"
        return release.release(effect, worker_identity())


def run_dispatcher() -> str:
    """The scheduled maintenance round (``jobs.dispatch``): ticks and missed joins."""
    return " ".join(f"{k}={v}" for k, v in dispatch.dispatch_once().items())
