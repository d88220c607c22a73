"""Waking the clusters for jobs and effects, and queue messages for artifact restores.

The jobs table is the queue (``jobs.claiming``): a job's row is its queue entry and an
effect's ledger row its release's. Enqueueing a job or an effect sends no message: a
``NOTIFY`` of the queue's channel, sent when the caller's transaction commits (never if
it rolls back), wakes the idle clusters serving it, which claim it from the row. Under
django-q2's ``sync`` (every task run in the caller's process) the job is delivered at
once instead. Restores stay plain django-q2 tasks (ids only, nothing private).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextvars import ContextVar

from django.apps import apps
from django.core.checks import Error
from django.db import connections, router, transaction
from django.db.models import Q
from django_q.tasks import async_task

from jobs import clock, conf, rules
from jobs.models import Artifact, Effect, Job

RUN_JOB = "jobs.tasks.run_job"
RELEASE_EFFECT = "jobs.tasks.release_effect"


def list_key(queue: str) -> str | None:
    """The django-q2 list (broker key) a job queue's cluster serves: ``default`` keeps the
    cluster's own (None: django-q2's ``Conf.CLUSTER_NAME``), any other queue its own,
    ``<Q_CLUSTER name>.<queue>``. ``manage.py jobs_worker --queue`` serves these keys."""
    from django_q.conf import Conf

    if not queue or queue == rules.DEFAULT_QUEUE:
        return None
    return f"{Conf.PREFIX}.{queue}"


def serving_keys(queues: list[str]) -> list[str]:
    """The broker keys a worker started for ``queues`` serves."""
    from django_q.conf import Conf

    return list(dict.fromkeys(list_key(q) or Conf.CLUSTER_NAME for q in queues))


def _sync() -> bool:
    from django_q.conf import Conf

    return bool(Conf.SYNC)


def enqueue_job(job: Job) -> None:
    """Make ``job``'s queue look at it: call in the transaction that made it due (or due
    later: an idle cluster learns the nearer due time)."""
    enqueue_jobs([job])


def enqueue_jobs(jobs: Iterable[Job], *, due_now: bool = True) -> int:
    """Wake the clusters serving ``jobs``' queues, once per queue; returns how many jobs.

    ``due_now`` False: the jobs wait (``run_after``, a retry's backoff); an idle cluster
    wakes to learn the nearest due time. Under ``sync`` a job due now is run at once
    (``jobs.tasks.run_job``) and a waiting one is left to a cluster."""
    jobs = list(jobs)
    if not jobs:
        return 0
    if _sync():
        if due_now:
            for job in jobs:
                async_task(RUN_JOB, job.pk, task_name=f"job-{job.pk}")
        return len(jobs)
    notify_queues({job.queue for job in jobs})
    return len(jobs)


def notify_queues(queues: Iterable[str]) -> None:
    """Wake the idle clusters serving ``queues`` (a NOTIFY per queue's channel, sent when the
    caller's transaction commits, never if it rolls back)."""
    from django_q.conf import Conf

    alias = Conf.ORM or "default"
    if connections[alias].vendor != "postgresql":
        return  # no LISTEN there: an idle cluster looks every Q_CLUSTER["poll"] seconds
    channels = sorted({channel_of(q) for q in queues})
    with connections[alias].cursor() as cursor:
        for channel in channels:
            cursor.execute("SELECT pg_notify(%s, '')", [channel])


# The queues a cluster worker's task claims from as soon as its delivery ends (its own
# follow-on, else the pusher woken by the task's end): a job this delivery releases to
# one of them is started by this cluster at once, without a NOTIFY to every cluster.
_claimed_next: ContextVar[frozenset[str]] = ContextVar("jobs_claimed_next", default=frozenset())


@contextlib.contextmanager
def claiming_next(queues: Iterable[str]) -> Iterator[None]:
    """Within: the running delivery's cluster claims ``queues``' next job when it ends."""
    token = _claimed_next.set(frozenset(queues))
    try:
        yield
    finally:
        _claimed_next.reset(token)


def claimed_next() -> frozenset[str]:
    """The queues this delivery's cluster claims from as soon as it ends (``claiming_next``;
    empty outside a cluster worker's task)."""
    return _claimed_next.get()


def claimed_next_here(queue: str) -> bool:
    """Whether a job released to ``queue`` now is claimed by this delivery's cluster as
    soon as the delivery ends (``claiming_next``): no other cluster need be woken."""
    return queue in claimed_next()


def channel_of(queue: str) -> str:
    """The NOTIFY channel the clusters serving ``queue`` listen on (PostgreSQL only)."""
    from django_q.conf import Conf

    from jobs.broker import channel_for  # psycopg: only where PostgreSQL is

    return channel_for(list_key(queue) or Conf.CLUSTER_NAME)


def enqueue_effect(effect: Effect) -> None:
    """Make the default queue's clusters look at ``effect``'s release (its ledger row is
    the queue entry); under ``sync`` it is released at once."""
    if _sync():
        async_task(RELEASE_EFFECT, effect.pk, task_name=f"effect-{effect.pk}")
        return
    notify_queues([rules.DEFAULT_QUEUE])


def enqueue_restore(artifact: Artifact) -> bool:
    """Ask a worker to restore ``artifact``, unless a restore of it is already in flight.

    One conditional UPDATE takes the artifact's restore marker (free, or older than
    ``conf.restore_stale_seconds()`` by the server's clock) and the message commits
    with it, so however many readers find a bad file, one restore is queued. False
    when another request holds the marker, or the artifact is lost.
    """
    with transaction.atomic():
        taken = (
            Artifact.objects.filter(pk=artifact.pk, state=Artifact.State.STORED)
            .filter(
                Q(restore_requested_at__isnull=True)
                | Q(restore_requested_at__lt=clock.before(conf.restore_stale_seconds()))
            )
            .update(restore_requested_at=clock.Now())
        )
        if taken:
            async_task(
                "jobs.restore.restore_artifact",
                artifact.pk,
                task_name=f"restore-artifact-{artifact.pk}",
            )
    return bool(taken)


# --- system checks (registered by jobs.checks) -------------------------------------------


def check_django_q(app_configs=None, **kwargs):
    """Jobs are enqueued through django-q2: its app (and tables) must be there."""
    if not apps.is_installed("django_q"):
        return [
            Error(
                "'django_q' must be in INSTALLED_APPS",
                hint="jobs enqueue through django-q2; its tables come from its migrations "
                "(without them migrate fails on django_q_schedule).",
                id="jobs.E020",
            )
        ]
    return []


CLAIMING_BROKER = "jobs.claiming.ClaimingBroker"
ORM_CLAIMING_BROKER = "jobs.claiming_orm.OrmClaimingBroker"
CLAIMING_BROKERS = (CLAIMING_BROKER, ORM_CLAIMING_BROKER)


def _broker_hint(vendor: str) -> str:
    fits = CLAIMING_BROKER if vendor == "postgresql" else ORM_CLAIMING_BROKER
    return (
        f"Set Q_CLUSTER['broker_class'] = {fits!r}, or build Q_CLUSTER with "
        "jobs.q_cluster(DATABASES) in settings (docs/app/quickstart.md)."
    )


def check_broker(app_configs=None, **kwargs):
    """django-q2's broker is the app's claiming broker on the jobs' database.

    The jobs table is the queue: a job has no message, so a cluster on any other broker
    (django-q2's ORM broker, ``jobs.broker.PostgresBroker``, Redis...) would never take
    one. ``Q_CLUSTER['orm']`` names the database it claims from.
    """
    cluster = conf.q_cluster()
    if not cluster:
        return []  # jobs.E001 names the missing Q_CLUSTER
    if cluster.get("sync"):
        return []  # every task runs in the caller's process: no cluster claims anything
    alias = cluster.get("orm")
    broker_class = cluster.get("broker_class") or ""
    jobs_db = router.db_for_write(apps.get_model("jobs", "Job"))
    vendor = connections[alias if alias in connections else jobs_db].vendor
    if broker_class not in CLAIMING_BROKERS:
        what = repr(broker_class) if broker_class else "unset (django-q2's ORM broker)"
        return [
            Error(
                f"Q_CLUSTER['broker_class'] is {what}: no cluster on it claims the jobs",
                hint=_broker_hint(vendor)
                + " The jobs table is the queue; a job has no message for another broker.",
                id="jobs.E021",
            )
        ]
    if not alias:
        return [
            Error(
                "Q_CLUSTER['orm'] must name a database: the jobs are claimed there",
                hint=f"Q_CLUSTER['orm'] = {jobs_db!r}.",
                id="jobs.E021",
            )
        ]
    if alias != jobs_db:
        return [
            Error(
                f"Q_CLUSTER['orm'] is {alias!r} but jobs are written to {jobs_db!r}",
                hint="The cluster claims jobs from the database they are written to.",
                id="jobs.E022",
            )
        ]
    if broker_class == CLAIMING_BROKER and vendor != "postgresql":
        return [
            Error(
                f"Q_CLUSTER['broker_class'] is {broker_class!r} but the database "
                f"{alias!r} is {vendor}",
                hint="The PostgreSQL claiming broker needs LISTEN/NOTIFY and SKIP LOCKED: "
                f"on this database use {ORM_CLAIMING_BROKER!r}.",
                id="jobs.E023",
            )
        ]
    return []
