"""The effect path keeps the job path's promises: a budget, an atomic history, no inline sends."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.utils import timezone
from django_q.models import OrmQ

from jobs import claiming, rules
from jobs.delivery import release
from jobs.engine import effect_machine
from jobs.models import Effect, EffectEvent, Job
from jobs.tasks import release_effect
from tests.jobs.helpers import deliver, request_job, run_queued_effects

State = Effect.State
Action = EffectEvent.Action


def missing_event_versions(effect: Effect) -> list[int]:
    """Versions of ``effect`` that no event recorded (invariant 10 says: none)."""
    seen = set(effect.events.values_list("version", flat=True))
    return [v for v in range(1, effect.version + 1) if v not in seen]


def _job(user, *providers: str, kind: str = "test.release_check_raises", subject=None) -> Job:
    job, _ = request_job(
        kind,
        subject_type="auth.user",
        subject_id=subject or user.pk,
        params={"recipient": user.pk, "providers": list(providers)},
    )
    return job


def _time_passes(effect: Effect) -> None:
    """Skip the backoff: the effect is due."""
    now = timezone.now()
    Effect.objects.filter(pk=effect.pk, state__in=[State.PENDING, State.UNKNOWN]).update(
        next_attempt_at=now - timedelta(seconds=1)
    )


def _releasable(**filters) -> list[int]:
    """The effects a sender may lease now, by their ledger rows (the ledger is the queue)."""
    due = Effect.objects.filter(rules.to_q(rules.EFFECT_RELEASABLE), **filters)
    return list(due.values_list("pk", flat=True))


@pytest.mark.postgres
@pytest.mark.django_db
def test_release_check_that_always_raises__stops_at_the_budget_in_needs_review(make_user, settings):
    settings.JOBS_EFFECT_MAX_ATTEMPTS = 4
    user = make_user()
    job = _job(user, "inapp", "email")
    deliver(job.pk, worker="w1")
    assert Job.objects.get(pk=job.pk).state == Job.State.SUCCEEDED, "publish is not undone"
    rounds = 0
    while Effect.objects.filter(job=job, state__in=[State.PENDING, State.UNKNOWN]).exists():
        rounds += 1
        assert rounds < 20, "the effect path retries forever"
        for effect in Effect.objects.filter(job=job):
            _time_passes(effect)
        run_queued_effects()  # what a cluster's claim of each due effect runs
    for effect in Effect.objects.filter(job=job):
        assert effect.state == State.NEEDS_REVIEW, effect.reason
        assert effect.attempts == effect.max_attempts == 4
        assert "exhausted" in effect.reason and effect.last_error_code == "RuntimeError"
        actions = list(effect.events.values_list("action", flat=True))
        assert actions.count(Action.CHECK) == 4 and Action.SEND not in actions, "nothing sent"
        assert missing_event_versions(effect) == []
    assert _releasable(job=job) == [], "a spent budget is never claimed again"
    assert claiming.claims().claim_effect("w9") is None
    assert not OrmQ.objects.exists()
    from django.core import mail

    assert mail.outbox == []


@pytest.mark.postgres
@pytest.mark.django_db
def test_sender_that_keeps_dying__the_claim_stops_at_the_budget(make_user, settings):
    settings.JOBS_EFFECT_MAX_ATTEMPTS = 3
    user = make_user()
    job = _job(user, "email", kind="test.notify_only")
    deliver_without_effects(job)
    effect = Effect.objects.get(job=job)
    for n in range(1, 4):
        assert (
            effect_machine.claim_send(effect, f"sender-{n}") == "claimed"
        )  # then the process dies
        Effect.objects.filter(pk=effect.pk).update(
            lease_expires_at=timezone.now() - timedelta(seconds=1)
        )
        effect.refresh_from_db()
    assert effect.attempts == 3
    assert effect_machine.claim_send(effect, "sender-4") == State.NEEDS_REVIEW
    effect.refresh_from_db()
    assert effect.state == State.NEEDS_REVIEW and effect.attempts == 3
    assert effect.events.last().action == Action.STOP
    assert missing_event_versions(effect) == []
    with pytest.raises(IntegrityError), transaction.atomic():
        Effect.objects.filter(pk=effect.pk).update(attempts=4)  # the database backstop


def deliver_without_effects(job: Job) -> None:
    from jobs.delivery.runner import run_delivery

    run_delivery(job.pk, worker="w1")  # its effects stay due on the ledger, unsent


# --- each arrow commits with its event, or not at all ----------------------------------------


@pytest.fixture
def events_refused(db):
    """Make every EffectEvent INSERT fail in the database: the arrow before it must roll back."""
    # Its tests are marked postgres: on SQLite they skip visibly, in CI they fail (conftest).
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION test_refuse_event() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'event refused by the test'; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER test_refuse_event BEFORE INSERT ON jobs_effectevent "
            "FOR EACH ROW EXECUTE FUNCTION test_refuse_event()"
        )
    yield  # the test's transaction rolls the trigger back


def _effect_in(user, state: str, *, subject: int) -> Effect:
    job = _job(user, "email", kind="test.notify_only", subject=subject)
    deliver_without_effects(job)
    effect = Effect.objects.get(job=job)
    Effect.objects.filter(pk=effect.pk).update(state=state)
    effect.refresh_from_db()
    return effect


ARROWS = {
    "claim": (State.PENDING, lambda e: effect_machine.claim_send(e, "w1")),
    "release": (State.PENDING, lambda e: release.release(e, "w1")),
    "send_again": (State.NEEDS_REVIEW, lambda e: effect_machine.send_again(e, operator="op")),
    "recheck": (State.WITHHELD, lambda e: effect_machine.recheck_withheld(e, operator="op")),
    "mark_sent": (State.NEEDS_REVIEW, lambda e: effect_machine.mark_sent(e, operator="op")),
}


@pytest.mark.postgres
@pytest.mark.parametrize("arrow", sorted(ARROWS))
def test_ledger_arrow__rolls_back_when_its_event_cannot_be_written(
    arrow, make_user, events_refused
):
    state, move = ARROWS[arrow]
    effect = _effect_in(make_user(), state, subject=1)
    before = Effect.objects.filter(pk=effect.pk).values().get()
    with pytest.raises(DatabaseError, match="event refused"):
        move(effect)
    assert Effect.objects.filter(pk=effect.pk).values().get() == before, "no arrow without event"
    assert not OrmQ.objects.exists(), "and no message either way"
    assert not EffectEvent.objects.exists()


# --- operator actions enqueue and return; a worker sends --------------------------------------


@pytest.mark.django_db
def test_send_again__makes_it_due_with_a_fresh_budget_and_the_operator_named(make_user, settings):
    settings.JOBS_EFFECT_MAX_ATTEMPTS = 2
    effect = _effect_in(make_user(email="r@example.org"), State.NEEDS_REVIEW, subject=1)
    Effect.objects.filter(pk=effect.pk).update(attempts=2, max_attempts=2)
    effect.refresh_from_db()
    assert effect_machine.send_again(effect, operator="alice")
    effect.refresh_from_db()
    assert effect.state == State.PENDING and effect.max_attempts == 4
    assert _releasable(pk=effect.pk) == [effect.pk], "due on its ledger row"
    assert not OrmQ.objects.exists(), "no message: a cluster claims it from the ledger"
    assert effect.events.get().actor == "operator:alice"
    assert release_effect(effect.pk) == State.APPLIED
    effect.refresh_from_db()
    assert effect.attempts == 3 and missing_event_versions(effect) == []
