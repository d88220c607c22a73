"""Messages for many jobs at once (``jobs.request_many``): one statement per queue, not per job.

A message is the one ``jobs.queue.enqueue_job`` sends through django-q2's ``async_task``
(the same signed package: func, the job's id, its name, its queue's list), written
straight into the broker's table: django-q2's ORM broker and ``jobs.broker.PostgresBroker``
share ``django_q_ormq``, so the rows of a whole batch go in with one INSERT (and, for the
PostgreSQL broker, one NOTIFY of the queue's channel). Call it inside the transaction
that creates the jobs: rows and messages commit together. Another broker, or
``Q_CLUSTER["sync"]``, gets one ``enqueue_job`` per job.

Messages for work due later (a retry's backoff, ``run_after``) are written here too, one
job or many: on the PostgreSQL broker with their lock at the job's due time, and the
jobs marked sent for it, in one statement (``enqueue_jobs_when_due``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from django.db import connections
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.brokers.orm import ORM
from django_q.conf import Conf
from django_q.humanhash import uuid
from django_q.models import OrmQ
from django_q.signals import pre_enqueue
from django_q.signing import SignedPackage

from jobs import queue, rules
from jobs.models import Job

FUNC = "jobs.tasks.run_job"

_NOTIFIED_INSERT = """
WITH message AS (
    INSERT INTO django_q_ormq (key, payload, lock)
    SELECT %s, payload, now() FROM unnest(%s::text[]) AS payload
    RETURNING id
)
SELECT (SELECT count(*) FROM message), pg_notify(%s, '')
"""


def enqueue_jobs(jobs: Sequence[Job]) -> int:
    """Put one message for each of ``jobs`` on its queue's list; returns how many."""
    if not jobs:
        return 0
    if queue.claims_jobs():  # the rows are the queue: wake their queues, once each
        queue.notify_queues({job.queue for job in jobs})
        return len(jobs)
    if Conf.SYNC:
        for job in jobs:
            queue.enqueue_job(job)
        return len(jobs)
    by_key: dict[str | None, list[Job]] = {}
    for job in jobs:
        by_key.setdefault(queue.list_key(job.queue), []).append(job)
    for key, group in by_key.items():
        _enqueue_group(key, group)
    return len(jobs)


def _enqueue_group(key: str | None, jobs: list[Job]) -> None:
    broker = get_broker(key)
    packages = [_package(job, key) for job in jobs]
    list_key = broker.list_key or Conf.CLUSTER_NAME
    if type(broker) is ORM:
        now = timezone.now()  # what the ORM broker's enqueue writes as the lock
        OrmQ.objects.using(Conf.ORM).bulk_create(
            [OrmQ(key=list_key, payload=p, lock=now) for p in packages]
        )
    elif _path(type(broker)) == "jobs.broker.PostgresBroker":  # by name: no psycopg import
        with connections[broker.get_connection()].cursor() as cursor:
            cursor.execute(_NOTIFIED_INSERT, [broker.key, packages, broker.channel])
    else:
        for job in jobs:
            queue.enqueue_job(job)


@functools.cache
def _ahead_insert() -> str:
    """Mark the waiting jobs sent for their due time and write their messages, held until
    then, in one statement (``enqueued_for`` and ``lock`` both the row's due time)."""
    waiting = rules.literal_sql(rules.WAITING, Job)
    return f"""
WITH due AS (
    UPDATE {Job._meta.db_table} SET enqueued_for = next_attempt_at
    WHERE id = ANY(%s) AND {waiting} AND next_attempt_at IS NOT NULL
    RETURNING id, next_attempt_at
), message AS (
    INSERT INTO django_q_ormq (key, payload, lock)
    SELECT %s, m.payload, GREATEST(d.next_attempt_at, now())
    FROM unnest(%s::bigint[], %s::text[]) AS m(id, payload) JOIN due d ON d.id = m.id
    RETURNING id
)
SELECT (SELECT count(*) FROM message), pg_notify(%s, '')
"""


def enqueue_job_when_due(job: Job) -> bool:
    """Send the message of a job that waits (a retry's backoff, ``run_after``) now, to be
    taken at its due time, and mark it sent for that due time; call in the transaction
    that makes it wait. False where the broker cannot hold a message until then: the
    dispatcher sends it when it is due (``jobs.dispatch``).

    One message per due time, as the dispatcher's (``enqueued_for`` = the due time, so
    its sweep sends none; one is sent again only past the re-drive window). The due
    time is read from the row (the retry wrote it by the server's clock), so message and
    job agree on it to the microsecond; the message carries it (``run_job``'s ``due``),
    which is how the supervisor's stall check tells it from a taken one.
    """
    if queue.claims_jobs():
        # The row's due time is when a cluster claims it: idle clusters wake to learn it.
        queue.notify_queues([job.queue])
        return True
    if not queue.wakes_at_due_time():
        return False
    rows = Job.objects.filter(rules.to_q(rules.WAITING), pk=job.pk)
    due = rows.values_list("next_attempt_at", flat=True).first()
    if due is None:
        return False
    job.next_attempt_at = due
    return enqueue_jobs_when_due([job]) == 1


def enqueue_jobs_when_due(jobs: Sequence[Job]) -> int:
    """Send ahead the messages of jobs that wait for their ``run_after`` (the PostgreSQL
    broker holds each until its job's ``next_attempt_at``; ``enqueue_job_when_due`` for
    one): one statement per queue. Where the broker
    cannot hold a message (django-q2's ORM broker, ``sync``) nothing is sent and the
    dispatcher sends each when it is due; returns how many were sent."""
    if jobs and queue.claims_jobs():
        queue.notify_queues({job.queue for job in jobs})
        return len(jobs)
    if not jobs or not queue.wakes_at_due_time():
        return 0
    by_key: dict[str | None, list[Job]] = {}
    for job in jobs:
        by_key.setdefault(queue.list_key(job.queue), []).append(job)
    sent = 0
    for key, group in by_key.items():
        broker = get_broker(key)
        ids = [job.pk for job in group]
        packages = [_package(job, key, due=job.next_attempt_at) for job in group]
        with connections[broker.get_connection()].cursor() as cursor:
            cursor.execute(_ahead_insert(), [ids, broker.key, ids, packages, broker.channel])
            sent += cursor.fetchone()[0]
    return sent


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _package(job: Job, key: str | None, *, due=None) -> str:
    """The signed package ``async_task`` builds for ``enqueue_job``'s call (with ``due``,
    ``enqueue_job_when_due``'s: the due time it is held for rides in it)."""
    tag = uuid()
    task = {"id": tag[1], "name": f"job-{job.pk}", "func": FUNC, "args": (job.pk,)}
    if key is not None:
        task["cluster"] = key
    if Conf.CACHED:
        task["cached"] = Conf.CACHED
    if Conf.ACK_FAILURES:
        task["ack_failure"] = Conf.ACK_FAILURES
    task["kwargs"] = {} if due is None else {"due": due.isoformat()}
    task["started"] = timezone.now()
    pre_enqueue.send(sender="django_q", task=task)
    return SignedPackage.dumps(task)
