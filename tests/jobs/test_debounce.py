"""Debounce, latest wins (issue 42 part 3, docs/app/debounce.md): the window's push, its
cap, a claim closing it, identity and keys, and races with a second connection.

Runs on both legs (SQLite and PostgreSQL); the lock tests need PostgreSQL. The
cross-process acceptance is tests/e2e/test_debounce_processes.py.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.db.models.functions import Now

import jobs
from jobs import claiming, conf, registry
from jobs.delivery.runner import run_claim
from jobs.models import Job
from tests.testapp.kinds import DEBOUNCED, DEBOUNCED_BY_KEY

pytestmark = pytest.mark.django_db(transaction=True)

SUBJECT = ("test.page", "7")


def _server_now():
    return Job.objects.annotate(now=Now()).values_list("now", flat=True).first()


def _claim_and_run(queue: str = "default"):
    """The queue's claim (the dequeue a worker runs), then the delivery of what it took."""
    claim = claiming.claims().claim_next(
        queue, "w-1", lease=conf.lease_seconds(), bound=conf.tenant_concurrency()
    )
    assert claim is not None and claim.won, claim
    return run_claim(claim, "w-1")


def _make_due(job: Job) -> None:
    Job.objects.filter(pk=job.pk).update(next_attempt_at=Now() - timedelta(seconds=1))


def test_request__the_first_request_opens_a_window_due_after_the_debounce():
    handle = jobs.request(DEBOUNCED, SUBJECT, params={"n": 1})
    job = Job.objects.get(pk=handle.id)
    now = _server_now()
    assert handle.created
    assert job.debounce_key == f"{DEBOUNCED}:test.page:7"
    assert job.debounce_replaced == 0
    assert timedelta(0) < job.next_attempt_at - now <= timedelta(seconds=1)
    assert timedelta(seconds=4) < job.debounce_until - now <= timedelta(seconds=5)


def test_request__a_request_in_the_window_replaces_the_params_and_pushes_the_due_time():
    first = jobs.request(DEBOUNCED, SUBJECT, params={"n": 1}).job
    Job.objects.filter(pk=first.pk).update(next_attempt_at=Now() + timedelta(seconds=0.2))
    second = jobs.request(DEBOUNCED, SUBJECT, params={"n": 2})
    third = jobs.request(DEBOUNCED, SUBJECT, params={"n": 3})
    job = Job.objects.get(pk=first.pk)
    assert (second.id, third.id) == (first.pk, first.pk)
    assert not second.created and not third.created
    assert job.params == {"n": 3}  # latest wins
    assert job.debounce_replaced == 2
    assert third.job.debounce_replaced == 2  # the handle's row is the replacement's
    # Pushed to a window after the last request, by the server's clock.
    assert timedelta(seconds=0.5) < job.next_attempt_at - _server_now() <= timedelta(seconds=1)
    assert Job.objects.filter(kind=DEBOUNCED).count() == 1


def test_request__the_push_stops_at_debounce_max_from_the_first_request():
    first = jobs.request(DEBOUNCED, SUBJECT, params={"n": 1}).job
    # The window's first request was 4.7 s ago (its cap is 0.3 s away), its last 0.9 s ago.
    Job.objects.filter(pk=first.pk).update(
        debounce_until=Now() + timedelta(seconds=0.3),
        next_attempt_at=Now() + timedelta(seconds=0.1),
    )
    jobs.request(DEBOUNCED, SUBJECT, params={"n": 2})
    job = Job.objects.get(pk=first.pk)
    assert job.next_attempt_at == job.debounce_until
    assert job.next_attempt_at - _server_now() <= timedelta(seconds=0.3)
    assert job.params == {"n": 2}


def test_request__a_due_time_pushed_further_by_flow_control_never_moves_earlier():
    first = jobs.request(DEBOUNCED, SUBJECT, params={"n": 1}).job
    Job.objects.filter(pk=first.pk).update(next_attempt_at=Now() + timedelta(seconds=30))
    jobs.request(DEBOUNCED, SUBJECT, params={"n": 2})
    assert Job.objects.get(pk=first.pk).next_attempt_at - _server_now() > timedelta(seconds=29)


def test_request__after_the_claim_a_new_revision_opens_a_second_window():
    first = jobs.request(DEBOUNCED, SUBJECT, params={"n": 1}).job
    jobs.request(DEBOUNCED, SUBJECT, params={"n": 2})
    _make_due(first)
    _claim_and_run()
    first.refresh_from_db()
    assert first.state == Job.State.SUCCEEDED
    assert jobs.JobHandle(first).result == {"params": {"n": 2}, "revision": 1}
    # The identity's job is closed: asking for it again returns it, as for any kind.
    again = jobs.request(DEBOUNCED, SUBJECT, params={"n": 2})
    assert (again.id, again.created) == (first.pk, False)
    with pytest.raises(jobs.JobConflict):
        jobs.request(DEBOUNCED, SUBJECT, params={"n": 3})
    second = jobs.request(DEBOUNCED, SUBJECT, revision=2, params={"n": 3})
    assert second.created and second.id != first.pk
    assert Job.objects.get(pk=first.pk).debounce_replaced == 1  # the claimed job unchanged
    assert second.job.debounce_replaced == 0


def test_request__a_newer_revision_in_the_window_moves_the_waiting_job_to_it():
    first = jobs.request(DEBOUNCED, SUBJECT, revision=29, params={"n": 1}).job
    moved = jobs.request(DEBOUNCED, SUBJECT, revision=30, params={"n": 2})
    job = Job.objects.get(pk=first.pk)
    assert moved.id == first.pk and not moved.created
    assert (job.output_revision, job.params, job.debounce_replaced) == (30, {"n": 2}, 1)
    assert moved.job.output_revision == 30


def test_request__a_kinds_debounce_key_shares_one_window_across_subjects():
    a = jobs.request(DEBOUNCED_BY_KEY, ("test.page", "1"), params={"customer": 5, "n": 1})
    b = jobs.request(DEBOUNCED_BY_KEY, ("test.page", "2"), params={"customer": 5, "n": 2})
    c = jobs.request(DEBOUNCED_BY_KEY, ("test.page", "3"), params={"customer": 6, "n": 3})
    assert b.id == a.id and c.id != a.id
    job = Job.objects.get(pk=a.id)
    assert job.debounce_key == f"{DEBOUNCED_BY_KEY}:customer:5"
    assert (job.subject_id, job.params) == ("2", {"customer": 5, "n": 2})  # latest wins whole


def test_request__an_operator_requeue_takes_the_job_out_of_its_window():
    first = jobs.request(DEBOUNCED, SUBJECT, params={"n": 1}).job
    from jobs.engine import job_machine

    assert job_machine.fail_by_operator(first, actor="op", reason="wrong")
    second = jobs.request(DEBOUNCED, SUBJECT, revision=2, params={"n": 2})
    assert second.created
    first.refresh_from_db()
    assert job_machine.requeue(first, actor="op")  # no second open window for the key
    assert Job.objects.get(pk=first.pk).debounce_key == ""


def test_kind__debounce_options_are_checked_at_registration():
    def handler(ctx):
        return None

    with pytest.raises(ValueError, match="debounce_max"):
        registry.register_kind("test.bad_debounce", handler, debounce=2, debounce_max=1)
    with pytest.raises(ValueError, match="positive"):
        registry.register_kind("test.bad_debounce", handler, debounce=0)
    with pytest.raises(ValueError, match="need debounce"):
        registry.register_kind("test.bad_debounce", handler, debounce_max=5)
    with pytest.raises(ValueError, match="periodic"):
        registry.register_kind("test.bad_debounce", handler, debounce=1, schedule="* * * * *")
    assert "test.bad_debounce" not in registry.kinds()
    kind = registry.register_kind("test.default_cap", handler, debounce=2)
    assert kind.debounce_max == 2 * registry.DEBOUNCE_MAX_WINDOWS


def test_request__run_after_and_request_many_are_refused_for_a_debounced_kind():
    from django.utils import timezone

    with pytest.raises(ValueError, match="debounced"):
        jobs.request(DEBOUNCED, SUBJECT, run_after=timezone.now())
    with pytest.raises(ValueError, match="debounced"):
        jobs.request_many([jobs.JobRequest(DEBOUNCED, SUBJECT)])
    assert not Job.objects.exists()


def test_admin__the_job_page_shows_how_many_requests_were_replaced(admin_client):
    handle = jobs.request(DEBOUNCED, SUBJECT, params={"n": 1})
    for n in range(2, 5):
        jobs.request(DEBOUNCED, SUBJECT, params={"n": n})
    page = admin_client.get(f"/admin/jobs/job/{handle.id}/change/").content.decode()
    assert "3 earlier requests replaced (latest wins); window open" in page


@pytest.mark.skipif(
    "connection.vendor != 'sqlite'", reason="the SQLite leg's test (it runs there in CI)"
)
def test_request__on_sqlite_one_window_a_key_and_the_claim_closes_it():
    """SQLite's leg (the ORM claim): a transaction's write lock from its start does what
    PostgreSQL's row locks do."""
    assert connection.vendor == "sqlite"
    first = jobs.request(DEBOUNCED, SUBJECT, params={"n": 1}).job
    for n in range(2, 6):
        jobs.request(DEBOUNCED, SUBJECT, params={"n": n})
    _make_due(first)
    _claim_and_run()
    second = jobs.request(DEBOUNCED, SUBJECT, revision=2, params={"n": 6})
    first.refresh_from_db()
    assert (first.state, first.params, first.debounce_replaced) == ("succeeded", {"n": 5}, 4)
    assert second.created and Job.objects.count() == 2


def _in_thread(target, *args):
    """Run ``target`` on its own connection (a second session); returns the thread and a box
    for its result or exception."""
    box: dict = {}

    def run():
        try:
            box["result"] = target(*args)
        except BaseException as exc:  # reported by the test
            box["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


@pytest.mark.postgres
def test_request__a_replacement_waiting_on_the_claims_lock_opens_a_new_window():
    """The claim holds the row (as its statement does from its FOR UPDATE to its commit)
    and moves it out of the window; the replacement that waited finds the window closed
    and opens a new one: the claimed job keeps the params it was claimed with."""
    first = jobs.request(DEBOUNCED, SUBJECT, params={"n": 1}).job
    with transaction.atomic():
        Job.objects.select_for_update().get(pk=first.pk)
        thread, box = _in_thread(
            lambda: jobs.request(DEBOUNCED, SUBJECT, revision=2, params={"n": 2}).job.pk
        )
        thread.join(0.5)
        assert thread.is_alive(), "the replacement must wait for the claim's row lock"
        Job.objects.filter(pk=first.pk).update(  # what the claim's CAS writes
            state="running",
            attempts=1,
            lease_owner="w-1",
            lease_expires_at=Now() + timedelta(seconds=30),
            version=first.version + 1,
        )
    thread.join(10)
    assert "error" not in box, box
    first.refresh_from_db()
    assert first.params == {"n": 1} and first.debounce_replaced == 0
    second = Job.objects.get(pk=box["result"])
    assert second.pk != first.pk and second.params == {"n": 2}


@pytest.mark.postgres
def test_request__concurrent_requests_for_one_key_make_one_waiting_job():
    """Eight sessions at once, each with its own params: one job, seven replacements, and
    the params of the replacement that committed last (the count it saw is the highest)."""
    barrier = threading.Barrier(8)

    def ask(n: int):
        barrier.wait()
        handle = jobs.request(DEBOUNCED, SUBJECT, params={"n": n})
        return handle.id, handle.job.debounce_replaced, n

    threads = [_in_thread(ask, n) for n in range(8)]
    results = []
    for thread, box in threads:
        thread.join(30)
        assert "error" not in box, box
        results.append(box["result"])
    assert len({job_id for job_id, _, _ in results}) == 1
    assert sorted(seen for _, seen, _ in results) == list(range(8))
    job = Job.objects.get()
    last = max(results, key=lambda r: r[1])
    assert job.debounce_replaced == 7 and job.params == {"n": last[2]}


@pytest.mark.postgres
def test_claim__passes_over_a_window_a_replacement_holds_then_takes_its_latest_params():
    """The queue's claim statement (``FOR UPDATE SKIP LOCKED``) meets a replacement's row
    lock: it passes the job over instead of waiting or taking the params being replaced,
    and once the replacement committed it takes the job with the latest params."""
    first = jobs.request(DEBOUNCED, SUBJECT, params={"n": 1}).job
    _make_due(first)
    lease, bound = conf.lease_seconds(), conf.tenant_concurrency()
    with transaction.atomic():  # a replacement in flight: its lock, its CAS
        Job.objects.select_for_update().get(pk=first.pk)
        Job.objects.filter(pk=first.pk, version=first.version).update(
            params={"n": 2}, debounce_replaced=1, version=first.version + 1
        )
        thread, box = _in_thread(
            lambda: claiming.claims().claim_next("default", "w-2", lease=lease, bound=bound)
        )
        thread.join(10)
        assert not thread.is_alive(), "the claim must not wait for the replacement's lock"
        assert "error" not in box, box
        assert box["result"] is None or not box["result"].won
    _claim_and_run()
    job = Job.objects.get(pk=first.pk)
    assert job.state == Job.State.SUCCEEDED and job.attempts == 1
    assert jobs.JobHandle(job).result == {"params": {"n": 2}, "revision": 1}
