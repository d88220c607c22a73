"""A decision racing a withdrawal, on PostgreSQL with two connections (two threads).

The decision write locks the request row before it reads the status, so a
withdrawal that commits first is seen (the decision is refused), and one that
comes second waits for the decision and then wins. Either way the request ends
withdrawn: no lost update.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from permits.models import PermitRequest, ReviewDecision
from permits.services import RequestWithdrawn, decide, withdraw
from tests.permits import factories

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
WAIT = 10  # seconds: a generous deadline, never a measured duration


def in_thread(target, *args) -> tuple[threading.Thread, dict]:
    """Run ``target`` on its own connection; its result or exception lands in the dict."""
    out: dict = {}

    def run():
        try:
            out["result"] = target(*args)
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def blocked_on_a_lock(thread: threading.Thread) -> bool:
    """Whether some backend waits on a row lock (the other thread's statement)."""
    with connection.cursor() as cursor:
        for _ in range(100):
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            if cursor.fetchone()[0]:
                return True
            thread.join(0.05)
    return False


@pytest.fixture
def setup(make_user):
    reviewer = make_user(username="racer")
    permit = factories.permit(reviewer=reviewer, status=PermitRequest.Status.IN_REVIEW)
    return reviewer, permit


def test_decide__withdrawal_committed_while_the_decision_waits_wins(setup):
    reviewer, permit = setup
    seen = PermitRequest.objects.get(pk=permit.pk)  # the view's copy: status in_review
    withdrawn, release = threading.Event(), threading.Event()

    def withdraw_and_hold():
        with transaction.atomic():
            withdraw(PermitRequest.objects.get(pk=permit.pk))
            withdrawn.set()
            release.wait(WAIT)  # the row stays locked until the test lets go

    holder, held = in_thread(withdraw_and_hold)
    assert withdrawn.wait(WAIT)
    decider, decided = in_thread(lambda: decide(seen, reviewer, decision="approve"))
    assert blocked_on_a_lock(decider), "the decision did not wait for the withdrawal's lock"
    release.set()
    holder.join(WAIT)
    decider.join(WAIT)
    assert "error" not in held
    assert isinstance(decided.get("error"), RequestWithdrawn), decided
    permit.refresh_from_db()
    assert permit.status == PermitRequest.Status.WITHDRAWN
    assert not ReviewDecision.objects.exists()


def test_decide__withdrawal_arriving_during_the_decision_waits_then_wins(setup):
    reviewer, permit = setup
    decided_event, release = threading.Event(), threading.Event()

    def decide_and_hold():
        with transaction.atomic():
            made = decide(PermitRequest.objects.get(pk=permit.pk), reviewer, decision="approve")
            decided_event.set()
            release.wait(WAIT)
        return made

    decider, decided = in_thread(decide_and_hold)
    assert decided_event.wait(WAIT)
    withdrawer, withdrew = in_thread(lambda: withdraw(PermitRequest.objects.get(pk=permit.pk)))
    assert blocked_on_a_lock(withdrawer), "the withdrawal did not wait for the decision's lock"
    release.set()
    decider.join(WAIT)
    withdrawer.join(WAIT)
    assert "error" not in decided and withdrew.get("result") is True, (decided, withdrew)
    permit.refresh_from_db()
    assert permit.status == PermitRequest.Status.WITHDRAWN  # the later withdrawal is kept
    assert ReviewDecision.objects.count() == 1  # made before the withdrawal: history
