"""django-q2 entry points. Messages carry only ids: nothing private in the queue.

Each delivery runs inside ``supervisor.delivery``: it marks progress for
``manage.py jobs_worker`` and reports a failure that escaped the engine (e.g. the
database refused the claim) by class and code only; django-q2 records it and
redelivers the message.

On the PostgreSQL broker a worker that finished a delivery keeps going (the
follow-on, docs/broker.md): for up to ``JOBS_FOLLOW_ON_SECONDS`` it acknowledges the
message whose outcome has just committed and takes the next due message of the same
list in one statement, and runs it here, without a round through django-q2's pusher,
task queue, result queue and monitor. A taken message is locked exactly as a pusher's
dequeue locks it, and deleted only after its outcome committed: a worker killed in
the middle of one is redelivered after ``retry``, as any other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from django.db import DatabaseError, InterfaceError
from django.dispatch import receiver
from django.utils import timezone
from django_q.conf import Conf
from django_q.monitor import save_task
from django_q.signals import post_execute, pre_execute
from django_q.signing import SignedPackage

from jobs import backends, dispatch, queue
from jobs.delivery import release, runner
from jobs.engine.job_machine import worker_identity
from jobs.exceptions import DeliveryFailed
from jobs.models import Effect
from jobs.supervisor import delivery

log = logging.getLogger("jobs.tasks")

RUN_JOB = "jobs.tasks.run_job"
RELEASE_EFFECT = "jobs.tasks.release_effect"
# What django-q2 does with these beyond calling the function (a hook, a group's result,
# a cached result, a task's own timeout, a chain): a message that asks for any of them
# is handed back to the pusher instead of being followed.
_DJANGO_Q_ONLY = ("hook", "group", "cached", "timeout", "chain", "sync", "iter_count", "save")

# The message this worker process is about to run, as django-q2's worker announced it
# (``pre_execute``, sent just before it calls the task): function name -> message id.
_running: dict[str, int] = {}


def run_job(job_id: int, due: str | None = None) -> str:
    """One delivery of a job; returns after every outcome is committed (then django-q2 acks).

    ``due``: the due time a message sent ahead was held for (``jobs.bulk.
    enqueue_job_when_due``); the delivery does not need it, the supervisor reads it.
    """
    return _deliver_then_follow(RUN_JOB, job_id)


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
    """Re-drive one effect (crash after publish, unknown outcome, temporary failure)."""
    return _deliver_then_follow(RELEASE_EFFECT, effect_pk)


def run_dispatcher() -> str:
    """The scheduled sweep (the fine-grained loop is ``manage.py jobs_dispatcher``)."""
    return " ".join(f"{k}={v}" for k, v in dispatch.dispatch_once().items())


def _deliver_job(job_id: int) -> str:
    with delivery("run_job", job_id):
        # The message names a job and wakes its queue: the claim may take a better job of
        # that queue (docs/app/scheduling.md); the result names the job it ran.
        result = runner.run_delivery(job_id)
        # A django.tasks task that this delivery finished: task_finished, now it is committed.
        backends.announce_finished(result.job_id, result.outcome)
        return result.outcome


def _deliver_effect(effect_pk: int) -> str:
    with delivery("release_effect", effect_pk):
        effect = Effect.objects.select_related("job").filter(pk=effect_pk).first()
        if effect is None:
            return "missing"
        return release.release(effect, worker_identity())


# For each task that may be followed: the function django-q2 calls, and its delivery.
FOLLOWED: dict[str, tuple[Callable[..., str], Callable[[int], str]]] = {
    RUN_JOB: (run_job, _deliver_job),
    RELEASE_EFFECT: (release_effect, _deliver_effect),
}


def _deliver_then_follow(name: str, ref: int) -> str:
    """The delivery django-q2 asked for, then the follow-on when django-q2 announced the
    message (``_note_message``); returns the delivery's outcome."""
    started, message = time.monotonic(), _running.pop(name, None)
    outcome = FOLLOWED[name][1](ref)
    if message is not None:
        follow_on(message, started=started)
    return outcome


@receiver(pre_execute, dispatch_uid="jobs.tasks.note_message")
def _note_message(sender, func=None, task=None, **kwargs) -> None:
    """Remember which message the worker is about to run (one of ours only)."""
    _running.clear()
    name = (task or {}).get("func")
    if name in FOLLOWED and task.get("ack_id") and not (task.get("sync") or task.get("followed")):
        _running[name] = task["ack_id"]


# --- the follow-on ------------------------------------------------------------------


def follow_on(done: int | None, *, started: float, list_key: str | None = None) -> int:
    """Take and run the next due messages of ``done``'s list (or ``list_key``'s) until the
    budget is spent or none is due; ``done`` is the message whose outcome has just
    committed. Returns how many messages were run here.

    Only on the PostgreSQL broker, outside ``sync``. The budget counts from the start of
    django-q2's task (``started``, monotonic): its alarm and its guard time the whole call.
    """
    budget = runner.follow_on_budget()
    if budget <= 0 or not queue.on_postgres_broker():
        return 0
    from jobs.broker import PostgresBroker

    broker = PostgresBroker(list_key=list_key)
    ran = _follow(broker, done, list_key, started, budget)
    if ran:
        # One line a django-q2 task, not a message: how much of the queue went this way.
        took = (time.monotonic() - started) * 1000
        log.info("worker followed on to %d message(s); the task took %.0f ms", ran, took)
    return ran


def _follow(broker, done: int | None, list_key: str | None, started: float, budget: float) -> int:
    ran = 0  # once a message ran here, ``done`` is that one: ours to acknowledge
    try:
        while time.monotonic() - started < budget:
            message = broker.take_after(done, list_key)
            done = None
            if message is None:
                return ran
            msg_id, payload, list_key = message
            call = _followable(payload)
            if call is None:
                broker.hand_back(msg_id)  # a pusher takes it and django-q2 runs it as usual
                return ran
            ran += 1
            if not _run_followed(call, msg_id, broker):
                return ran
            done = msg_id
        if ran:
            broker.acknowledge(done)
    except (DatabaseError, InterfaceError) as exc:
        # What was taken and not finished is handed out again after ``retry``; the first
        # message, if this failed before deleting it, is django-q2's monitor's to
        # acknowledge, a later one is redelivered and recorded as a duplicate delivery.
        log.warning("follow-on stopped (%s)", type(exc).__name__)
    return ran


def _run_followed(call: dict, msg_id: int, broker) -> bool:
    """Run a followed message's task as django-q2's worker and monitor would have (the
    signals, the failure saved); True when it returned an outcome."""
    task = {**call, "cluster": Conf.CLUSTER_NAME, "ack_id": msg_id, "followed": True}
    func, deliver = FOLLOWED[task["func"]]
    pre_execute.send(sender="django_q", func=func, task=task)
    try:
        task["result"], task["success"] = deliver(task["args"][0]), True
    except DeliveryFailed as exc:
        # As django-q2 does for a task that raised: the failure saved (``jobs_stats``
        # counts it), the message redelivered after ``retry`` (it stays locked), or
        # acknowledged when the task asked for that.
        task.update(result=str(exc), success=False)
    task["stopped"] = timezone.now()
    if not task["success"]:
        save_task(task, broker)
        if task.get("ack_failure"):
            broker.acknowledge(msg_id)
    post_execute.send(sender="django_q", task=task)
    return task["success"]


def _followable(payload: str) -> dict | None:
    """The task of a message this worker may run itself, or None."""
    try:
        task = SignedPackage.loads(payload)
    except Exception:
        return None  # the pusher logs it and fails it, as for any message it cannot read
    func, args = task.get("func"), task.get("args") or ()
    if func not in FOLLOWED or len(args) != 1 or not isinstance(args[0], int):
        return None
    if any(task.get(option) for option in _DJANGO_Q_ONLY):
        return None
    if set(task.get("kwargs") or {}) - {"due"}:
        return None
    return task
