"""Queue messages for jobs, effects and artifact restores: ids only, nothing private in the queue.

Call these inside the transaction that makes the row due: with django-q2's ORM
broker on the same database, the row and its message commit together or not at all.
"""

from __future__ import annotations

from django.apps import apps
from django.core.checks import Error
from django.db import connections, router, transaction
from django.db.models import Q
from django_q.tasks import async_task

from jobs import clock, conf, rules
from jobs.models import Artifact, Effect, Job


def list_key(queue: str) -> str | None:
    """The django-q2 list (broker key) a job queue's messages go to: ``default`` keeps the
    cluster's own (None: django-q2's ``Conf.CLUSTER_NAME``), any other queue its own,
    ``<Q_CLUSTER name>.<queue>``. ``manage.py jobs_worker --queue`` serves these keys."""
    from django_q.conf import Conf

    if not queue or queue == rules.DEFAULT_QUEUE:
        return None
    return f"{Conf.PREFIX}.{queue}"


def serving_keys(queues: list[str]) -> list[str]:
    """The broker keys a worker started for ``queues`` takes messages from."""
    from django_q.conf import Conf

    return list(dict.fromkeys(list_key(q) or Conf.CLUSTER_NAME for q in queues))


def enqueue_job(job: Job) -> None:
    """Put one message for ``job`` on its queue's list (it wakes that queue's workers).

    On the claiming broker (``jobs.claiming``) the job's row is its queue entry: only the
    NOTIFY that wakes the queue's idle clusters is sent, in the caller's transaction."""
    if claims_jobs():
        notify_queues([job.queue])
        return
    key = list_key(job.queue)
    route = {} if key is None else {"cluster": key}
    async_task("jobs.tasks.run_job", job.pk, task_name=f"job-{job.pk}", **route)


def on_postgres_broker() -> bool:
    """Whether the messages go through ``jobs.broker.PostgresBroker`` or the claiming broker
    built on it (not ``sync``, which runs a message at once)."""
    from django_q.conf import Conf

    return Conf.BROKER_CLASS in (POSTGRES_BROKER, CLAIMING_BROKER) and not Conf.SYNC


def claims_jobs() -> bool:
    """Whether the clusters claim jobs from the jobs table (``jobs.claiming``): a job then
    has no message; its row's due time is when a cluster takes it."""
    from django_q.conf import Conf

    return Conf.BROKER_CLASS in CLAIMING_BROKERS and not Conf.SYNC


def notify_queues(queues) -> None:
    """Wake the idle clusters serving ``queues`` (a NOTIFY per queue's channel, sent when the
    caller's transaction commits, never if it rolls back)."""
    from django_q.conf import Conf

    from jobs.broker import channel_for

    alias = Conf.ORM or "default"
    if connections[alias].vendor != "postgresql":
        return  # no LISTEN there: an idle cluster looks every Q_CLUSTER["poll"] seconds
    channels = sorted({channel_for(list_key(q) or Conf.CLUSTER_NAME) for q in queues})
    with connections[alias].cursor() as cursor:
        for channel in channels:
            cursor.execute("SELECT pg_notify(%s, '')", [channel])


def wakes_at_due_time() -> bool:
    """Whether a message can be sent now for work due later: the PostgreSQL broker takes a
    message only once the server's clock passed its due time (django-q2's ORM broker
    compares with the worker's clock)."""
    return on_postgres_broker()


def enqueue_effect(effect: Effect) -> None:
    """Put one message for sending ``effect`` on the queue (on the claiming broker the
    effect's row is its queue entry: only the default queue's clusters are woken)."""
    if claims_jobs():
        notify_queues([rules.DEFAULT_QUEUE])
        return
    async_task("jobs.tasks.release_effect", effect.pk, task_name=f"effect-{effect.pk}")


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


POSTGRES_BROKER = "jobs.broker.PostgresBroker"
CLAIMING_BROKER = "jobs.claiming.ClaimingBroker"
ORM_CLAIMING_BROKER = "jobs.claiming_orm.OrmClaimingBroker"
CLAIMING_BROKERS = (CLAIMING_BROKER, ORM_CLAIMING_BROKER)


def check_broker(app_configs=None, **kwargs):
    """The queue's table on the jobs' database: the job row and its message commit together.

    Two brokers keep that promise: django-q2's ORM broker and ``jobs.broker.PostgresBroker``
    (the same table, woken by NOTIFY; PostgreSQL only). Any other keeps its messages
    elsewhere, where a message can be lost between the job's commit and the enqueue.
    """
    cluster = conf.q_cluster()
    if not cluster:
        return []  # jobs.E001 names the missing Q_CLUSTER
    alias = cluster.get("orm")
    broker_class = cluster.get("broker_class") or ""
    jobs_db = router.db_for_write(apps.get_model("jobs", "Job"))
    if broker_class and broker_class not in (POSTGRES_BROKER, *CLAIMING_BROKERS):
        return [
            Error(
                f"Q_CLUSTER['broker_class'] is {broker_class!r}: jobs need their queue "
                "messages in the jobs' database",
                hint=f"Leave broker_class unset (django-q2's ORM broker), or set it to "
                f"{ORM_CLAIMING_BROKER!r} (the jobs table is the queue, any database) or on "
                f"PostgreSQL to {CLAIMING_BROKER!r}. Another broker could lose a message "
                "between the job's commit and the enqueue.",
                id="jobs.E021",
            )
        ]
    if not alias:
        return [
            Error(
                "Q_CLUSTER['orm'] must name a database: the queue's table lives there",
                hint=f"Q_CLUSTER['orm'] = {jobs_db!r}. Both brokers the jobs run on (the ORM "
                f"broker and {POSTGRES_BROKER}) keep their messages in that database.",
                id="jobs.E021",
            )
        ]
    if alias != jobs_db:
        return [
            Error(
                f"Q_CLUSTER['orm'] is {alias!r} but jobs are written to {jobs_db!r}",
                hint="The message must commit in the same transaction as the job row.",
                id="jobs.E022",
            )
        ]
    vendor = connections[alias].vendor
    if broker_class in (POSTGRES_BROKER, CLAIMING_BROKER) and vendor != "postgresql":
        return [
            Error(
                f"Q_CLUSTER['broker_class'] is {broker_class!r} but the database "
                f"{alias!r} is {vendor}",
                hint="The PostgreSQL brokers need LISTEN/NOTIFY and SKIP LOCKED: on this "
                f"database use {ORM_CLAIMING_BROKER!r} (or django-q2's ORM broker).",
                id="jobs.E023",
            )
        ]
    return []
