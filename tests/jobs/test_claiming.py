"""The jobs table as the queue (``jobs.claiming.ClaimingBroker``): the dequeue is the claim.

In process, on PostgreSQL: the broker's ``dequeue`` is called as django-q2's pusher calls
it, and each package is run as a worker would (``jobs.tasks.run_claimed``). The real
``qcluster`` runs are in ``tests/e2e``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction
from django.db.models import F
from django_q.conf import Conf
from django_q.models import OrmQ
from django_q.signing import SignedPackage
from django_q.tasks import async_task

import jobs
from jobs import claiming, services, tasks
from jobs.models import Attempt, Job
from jobs.registry import kinds, register_kind

pytestmark = [pytest.mark.postgres]

KIND = "test.claiming"
ran: list[int] = []


def _record(ctx) -> list:
    ctx.check_owner()
    ran.append(ctx.job.pk)
    return []


if KIND not in kinds():
    register_kind(KIND, _record)


@pytest.fixture(autouse=True)
def claiming_broker(monkeypatch, settings):
    """The claiming broker, 2 workers, a fresh idle count, and a dequeue that does not wait
    long when it finds nothing (no LISTEN: it sleeps ``poll``)."""
    monkeypatch.setattr(Conf, "BROKER_CLASS", "jobs.claiming.ClaimingBroker")
    monkeypatch.setattr(Conf, "WORKERS", 2)
    monkeypatch.setattr(Conf, "POLL", 0.01)
    monkeypatch.setattr(claiming, "_shared", None)
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "broker_listen": False}
    ran.clear()
    yield
    ran.clear()


def ask(name: str, *, priority: int = 0, queue: str = "default") -> Job:
    return jobs.request(KIND, ("claiming", name), priority=priority, queue=queue).job


def broker(queues: tuple[str, ...] = ("default",)) -> claiming.ClaimingBroker:
    from jobs.queue import serving_keys

    keys = serving_keys(list(queues))
    return claiming.ClaimingBroker(list_key=keys[0], keys=keys)


def take(b: claiming.ClaimingBroker) -> list[dict]:
    """What django-q2's pusher takes at one wake, unpacked as it does: a dequeue, and the
    next ones at once while the broker handed a claim over before filling every idle
    worker (woken from idle, the first claim goes to its worker at once)."""
    got = []
    while True:
        got += [{**SignedPackage.loads(p), "ack_id": ack} for ack, p in b.dequeue() or []]
        if not b.handed_early:
            return got


def run(task: dict) -> str:
    """Run a package as django-q2's worker would, then say the worker is idle again."""
    try:
        if task["func"] == claiming.RUN_CLAIMED:
            return tasks.run_claimed(*task["args"])
        if task["func"] == claiming.RELEASE_CLAIMED:
            return tasks.release_claimed(*task["args"])
        return "plain"
    finally:
        claiming._release(1)


def test_claiming__a_job_has_no_message_and_the_dequeue_claims_and_runs_exactly_it(db):
    job = ask("one")
    assert OrmQ.objects.count() == 0, "the job's row is its queue entry"
    [task] = take(broker())
    assert task["func"] == "jobs.tasks.run_claimed" and task["args"][0] == job.pk
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING and job.attempts == 1
    assert task["args"][1:] == (job.lease_owner, job.attempt_set.get().pk, job.version)
    assert task["save"] is False, "django-q2 saves no result for an engine job"
    assert run(task) == Attempt.Outcome.SUCCEEDED and ran == [job.pk]
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED and job.attempt_set.count() == 1
    assert OrmQ.objects.count() == 0


def test_claiming__at_most_one_claim_per_idle_worker(db):
    for i in range(5):
        ask(f"idle-{i}")
    b = broker()
    first = take(b)
    assert len(first) == 2, "two workers, two claims"
    assert take(b) == [], "no worker is idle: nothing more is claimed"
    assert Job.objects.filter(state=Job.State.RUNNING).count() == 2
    run(first[0])
    assert len(take(b)) == 1, "one worker became idle: one more claim"


def test_claiming__a_worker_that_never_reported_is_forgotten_after_djangoq_timeout(db, monkeypatch):
    for i in range(3):
        ask(f"lost-{i}")
    b = broker()
    assert len(take(b)) == 2
    assert take(b) == []
    # Both tasks' workers were killed without a word: once the count stood full longer
    # than django-q2's timeout (no task outlives it), the cluster counts again.
    monkeypatch.setattr(Conf, "TIMEOUT", 0)
    b._full_since = (2, b._full_since[1] - 10)
    assert len(take(b)) == 1


def test_claiming__the_best_job_by_priority_is_claimed_first(db):
    for i in range(50):
        ask(f"low-{i}")
    high = ask("high", priority=10)
    [first, _second] = take(broker())
    assert first["args"][0] == high.pk


def test_claiming__a_queue_is_served_only_by_its_workers(db):
    reports = ask("report", queue="reports")
    ask("plain-default")
    [task] = take(broker(("reports",)))[:1]
    assert task["args"][0] == reports.pk
    assert take(broker(("reports",))) == [], "no other job of that queue"


@pytest.mark.django_db(transaction=True)  # a message is due once its enqueue committed
def test_claiming__plain_tasks_take_turns_with_jobs(monkeypatch):
    """100 engine jobs and 10 plain tasks enqueued together, one worker: the plain ones
    start before the 50th job (neither waits for the other to drain)."""
    monkeypatch.setattr(Conf, "WORKERS", 1)
    for i in range(100):
        ask(f"many-{i}")
    for i in range(10):
        async_task("math.floor", i)
    b, order = broker(), []
    while len(order) < 110:
        got = take(b)
        assert got, f"work left undelivered after {len(order)}"
        for task in got:
            order.append(task["func"])
            run(task)
            if task["func"] != claiming.RUN_CLAIMED:
                b.acknowledge(task["ack_id"])
    plain_at = [i for i, f in enumerate(order) if f == "math.floor"]
    jobs_before_last_plain = order[: plain_at[-1]].count(claiming.RUN_CLAIMED)
    print(f"plain tasks at positions {plain_at}")
    assert len(plain_at) == 10 and jobs_before_last_plain < 50


def test_claiming__an_expired_lease_is_claimed_again_and_the_first_worker_publishes_nothing(db):
    job = ask("expired")
    b = broker()
    [first] = take(b)
    # The first worker froze; its lease ran out.
    Job.objects.filter(pk=job.pk).update(
        lease_expires_at=F("lease_expires_at") - timedelta(hours=1)
    )
    claiming._release(1)
    b._claimer.look_now()
    [second] = take(b)
    assert second["args"][0] == job.pk and second["args"][2] != first["args"][2]
    assert run(first) == "stale", "the first claim is no longer held: it does nothing"
    assert run(second) == Attempt.Outcome.SUCCEEDED
    assert ran == [job.pk]
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED and job.attempts == 2


def test_claiming__a_worker_that_finished_claims_its_queues_next_jobs_itself(
    db, monkeypatch, settings
):
    """A burst is not handed job by job through the pusher: the worker keeps claiming (the
    same owner, one claim statement a job) while its queue has due work."""
    monkeypatch.setattr(Conf, "WORKERS", 1)
    # Room under django-q2's alarm whatever kinds' timeouts other tests registered.
    monkeypatch.setattr(Conf, "TIMEOUT", 600)
    settings.JOBS_FOLLOW_ON_SECONDS = 30
    made = [ask(f"burst-{i}").pk for i in range(5)]
    [task] = take(broker())
    assert tasks.run_claimed(*task["args"], **task["kwargs"]) == Attempt.Outcome.SUCCEEDED
    assert ran == made, "one task ran the whole queue, in order"
    assert Job.objects.filter(pk__in=made, state=Job.State.SUCCEEDED).count() == 5
    owners = set(Attempt.objects.filter(job_id__in=made).values_list("worker", flat=True))
    assert owners == {task["args"][1]}


def test_claiming__a_workers_task_claims_its_queues_next_jobs_and_says_so(db, monkeypatch):
    """The task runs its deliveries saying which queues its cluster claims from as soon as
    they end (``queue.claiming_next``): a sequence's head released to one of them needs
    no NOTIFY to every cluster (``postgres._publish_in_one``)."""
    from jobs import queue
    from jobs.delivery import runner

    seen = []
    adopted = runner.run_adopted

    def recorded(*args, **kwargs):
        seen.append((queue.claimed_next_here("default"), queue.claimed_next_here("other")))
        return adopted(*args, **kwargs)

    monkeypatch.setattr(runner, "run_adopted", recorded)
    ask("scope")
    [task] = take(broker())
    assert task["kwargs"]["queues"] == ["default"]
    assert tasks.run_claimed(*task["args"], **task["kwargs"]) == Attempt.Outcome.SUCCEEDED
    assert seen == [(True, False)]
    assert not queue.claimed_next_here("default"), "the scope ended with the task"


def test_claiming__a_cancel_asked_for_while_the_package_waited_runs_nothing(db):
    job = ask("cancelled")
    [task] = take(broker())
    services.cancel_job(Job.objects.get(pk=job.pk), operator="op")
    assert run(task) == "stale" and ran == []


def test_claiming__a_retry_is_claimed_when_due_without_any_message(db):
    job = ask("later")
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.RETRY_WAIT, next_attempt_at=F("created_at") + timedelta(hours=1)
    )
    b = broker()
    assert take(b) == [], "not due yet"
    assert OrmQ.objects.count() == 0
    Job.objects.filter(pk=job.pk).update(next_attempt_at=F("created_at") - timedelta(seconds=1))
    [task] = take(b)
    assert task["args"][0] == job.pk


def test_claiming__next_due_time_is_the_nearest_job_due_or_lease_expiry(db):
    job = ask("soon")
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.RETRY_WAIT, next_attempt_at=F("created_at") + timedelta(seconds=30)
    )
    due_in = broker()._next_due()
    assert due_in is not None and 0 < due_in <= 31


def test_claiming__woken_by_the_heartbeat_alone_an_idle_cluster_sends_one_statement(
    db, monkeypatch
):
    """An idle cluster whose wait ended by its heartbeat (no NOTIFY, no worker done, no due
    time) looks once at the nearest due time and claims nothing when nothing is due: one
    statement a heartbeat (issue 41: an idle worker, at most one statement a second). A job
    whose NOTIFY never reached it is due at that look, and claimed."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    b = broker()
    waits = []
    monkeypatch.setattr(b, "_wait_for_work", lambda *args: waits.append(args))
    b._quiet_wake = True
    with CaptureQueriesContext(connection) as queries:
        assert b.dequeue() is None
    assert len(queries) == 1, [q["sql"][:60] for q in queries]
    assert waits == [(None,)]
    job = ask("no-notify")
    b._quiet_wake = True
    [task] = take(b)
    assert task["args"][0] == job.pk


def test_claiming__a_look_that_found_nothing_waits_for_something_that_could_change_it(db):
    """An idle cluster looked and found nothing; a worker then finished a plain message
    (the dispatcher's minute): nothing it could see changed, so it does not look for jobs
    or messages again (its wait reads only the nearest due time). A claimed job's end (it
    may have freed a tenant's slot or queued sends) makes it look again, and a job that
    became due meanwhile is claimed (the claiming broker's wait also forgets on a NOTIFY
    and at a due time)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    b = broker()
    claiming._release(0, claimed=False)  # the wake: a plain message ended
    assert b.dequeue() is None  # looks once: nothing
    job = ask("after-the-look")  # its NOTIFY is not heard here (no LISTEN, no commit)
    claiming._release(0, claimed=False)
    with CaptureQueriesContext(connection) as queries:
        assert b.dequeue() is None
    looked = [q["sql"][:70] for q in queries]
    assert len(looked) == 1 and "min(due)" in queries[0]["sql"], looked  # the due time only
    claiming._release(0, claimed=True)  # a claimed job ended: the wait hears it,
    assert b.dequeue() is None
    [task] = take(b)  # and the next dequeue looks again and claims the job due on its row
    assert task["args"][0] == job.pk


def test_claiming__an_acknowledgement_that_meets_a_database_error_does_not_raise(db, monkeypatch):
    b = broker()

    def gone(task_id):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(b, "delete", gone)
    b.acknowledge(7)  # django-q2's monitor calls this outside any try: it must not raise
    b.acknowledge(0)  # a claimed job: nothing to acknowledge


@pytest.mark.django_db(transaction=True)
def test_claiming__concurrent_clusters_claim_each_job_once(settings):
    settings.JOBS_LEASE_SECONDS = 60
    made = {ask(f"race-{i}").pk for i in range(40)}
    barrier = threading.Barrier(4)

    def cluster(_i: int) -> list[int]:
        try:
            b, got = broker(), []
            barrier.wait()
            while True:
                batch = b._fill(2)
                if not batch:
                    return got
                for _ack, payload in batch:
                    got.append(SignedPackage.loads(payload)["args"][0])
        finally:
            connection.close()

    with ThreadPoolExecutor(4) as pool:
        claimed = [pk for got in pool.map(cluster, range(4)) for pk in got]
    assert sorted(claimed) == sorted(made), "every job claimed, none twice"
    assert not Attempt.objects.filter(outcome=Attempt.Outcome.DUPLICATE_DELIVERY).exists()


@pytest.mark.django_db(transaction=True)
def test_claiming__an_operator_cancel_racing_the_claim_spends_no_start_and_defers_nothing():
    """The race of issue 41: an operator's cancel holds the job's row (its transaction not
    yet committed) while a claim runs. The claim locks rows before any admission, so it
    passes over that job: the kind's only rate start of the hour is not spent, and no
    other job is deferred on a spent start."""
    from jobs import flow
    from jobs.executors import pgclaim
    from jobs.models import FlowRule

    flow.set_rule(f"kind:{KIND}", actor="test", rate=1, period_seconds=3600)
    first = ask("race-cancelled")
    holding, done = threading.Event(), threading.Event()

    def operator() -> None:
        try:
            with transaction.atomic():
                assert services.cancel_job(Job.objects.get(pk=first.pk), operator="op")
                holding.set()
                done.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=operator)
    thread.start()
    assert holding.wait(30)
    try:
        claim = pgclaim.claim_next("default", "w1", lease=60, bound=4)
    finally:
        done.set()
        thread.join()
    assert claim is None, "the row the operator holds is passed over, not waited for"
    rule = FlowRule.objects.get(scope=f"kind:{KIND}")
    assert rule.next_free_at is None, "no rate start was spent"
    assert Job.objects.get(pk=first.pk).state == Job.State.CANCELLED

    second = ask("race-next")
    claim = pgclaim.claim_next("default", "w1", lease=60, bound=4)
    assert claim is not None and claim.won and claim.job.pk == second.pk
    assert not Job.objects.filter(state=Job.State.RETRY_WAIT).exists(), "nothing deferred"


def test_claiming__an_external_effect_is_leased_from_the_ledger_and_sent_once(db, make_user):
    """No message for a release either: the publish leaves the e-mail effect pending in
    the ledger, the next dequeue leases it (sending, one attempt) and a worker sends it."""
    from django.core import mail

    from jobs.models import Effect

    user = make_user(email="reviewer@example.org")
    job = jobs.request(
        "test.notify_only",
        ("auth.user", user.pk),
        params={"recipient": user.pk, "providers": ["email"]},
    ).job
    b = broker()
    [task] = take(b)
    run(task)
    effect = Effect.objects.get(job=job)
    assert effect.state == Effect.State.PENDING and OrmQ.objects.count() == 0
    [release] = take(b)
    assert release["func"] == "jobs.tasks.release_claimed" and release["args"][0] == effect.pk
    effect.refresh_from_db()
    assert (effect.state, effect.attempts) == (Effect.State.SENDING, 1)
    assert run(release) == Effect.State.APPLIED
    assert len(mail.outbox) == 1
    assert take(b) == [], "nothing more is due"
    assert OrmQ.objects.count() == 0


def test_claiming__an_adopted_claim_counts_its_lease_from_the_claim_not_the_adoption(db):
    """A package that waited before its worker took it: the worker's first heartbeat is
    due a third of the lease after the claim, so the lease cannot run out unnoticed."""
    from jobs.delivery import runner

    ask("waited")
    [task] = take(broker())
    job_id, owner, attempt_id, version = task["args"]
    Attempt.objects.filter(pk=attempt_id).update(started_at=F("started_at") - timedelta(seconds=5))
    claim = runner.adopt(job_id, owner, attempt_id, version)
    assert claim.won and 5 <= claim.attempt.claimed_ago < 60


@pytest.mark.django_db(transaction=True)
def test_wait__a_full_cluster_waits_for_a_worker_not_for_notifies(monkeypatch, settings):
    """Every busy cluster heard every NOTIFY (a sequence's release sends one a job) and
    woke for each, though it had no worker to give a job to: full, it waits on its
    workers' pipe alone; idle, on the NOTIFYs too."""
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "broker_listen": True}
    b = broker()
    waited = []

    def select_(fds, *_args):
        waited.append(list(fds))
        return [], [], []

    monkeypatch.setattr(claiming.select, "select", select_)
    in_hand, pipe, _w = claiming._make_shared()
    try:
        in_hand.value = b.capacity  # every worker busy
        b._wait_for_work(None)
        in_hand.value = 0
        b._wait_for_work(None)
        listener = b._listener.fileno()
    finally:
        in_hand.value = 0
        b.close()
    assert waited == [[pipe], [pipe, listener]]
