"""The testing mode (``jobs.testing``): inline and manual runs through the engine's own
delivery and release, found from the rows, never from the queue's messages."""

from __future__ import annotations

import dataclasses

import pytest
from django.core import mail
from django_q.models import OrmQ

import jobs
import jobs.api
import jobs.testing
from jobs import registry
from jobs.delivery.runner import claim_for
from jobs.models import Attempt, Effect, Job
from tests.docs.shop_example import test_welcome
from tests.jobs.helpers import expire_lease, make_due

pytestmark = pytest.mark.django_db

EXAMPLES = [test_welcome.test_welcome__inline, test_welcome.test_welcome__manual]


def _welcome_with(handler, monkeypatch) -> None:
    """Swap shop.welcome's handler for this test (the registry is restored after it)."""
    kind = registry.get_kind("shop.welcome")
    monkeypatch.setitem(registry._kinds, "shop.welcome", dataclasses.replace(kind, handler=handler))


def _twice_in_the_ledger(ctx):
    """A bug: the same welcome under two effect names, so two ledger rows, two mails."""
    (spec,) = test_welcome.jobkinds.welcome(ctx)
    return [spec, dataclasses.replace(spec, name="welcome-mail-again")]


def _mails_itself_too(ctx):
    """A bug: the handler mails on its own (outside the ledger) and returns the effect."""
    from django.core.mail import send_mail

    send_mail("Welcome", "hello", None, ["ada@example.org"])
    return test_welcome.jobkinds.welcome(ctx)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda f: f.__name__)
def test_example__passes_with_the_kind_as_written(example):
    example()


@pytest.mark.parametrize("bug", [_twice_in_the_ledger, _mails_itself_too], ids=lambda f: f.__name__)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda f: f.__name__)
def test_example__fails_when_the_kind_sends_its_effect_twice(example, bug, monkeypatch):
    _welcome_with(bug, monkeypatch)
    with pytest.raises(AssertionError):
        example()
    assert len(mail.outbox) == 2  # what the example's assertions caught


def test_example__the_same_effect_returned_twice_is_one_ledger_row(monkeypatch, make_user):
    """The ledger's identity (job, revision, name, recipient): a repeat is not a second send."""
    _welcome_with(lambda ctx: test_welcome.jobkinds.welcome(ctx) * 2, monkeypatch)
    user = make_user(email="ada@example.org")
    with jobs.testing.run_inline():
        handle = jobs.request("shop.welcome", user, params={"user_id": user.pk})
    rows = [(e.name, e.state) for e in jobs.testing.effects("shop.welcome")]
    assert (handle.state, rows, len(mail.outbox)) == (
        "succeeded",
        [("welcome-mail", "applied")],
        1,
    )


def test_run_inline__request_returns_after_the_job_and_its_effects(make_user):
    user = make_user()
    with jobs.testing.run_inline():
        handle = jobs.request("test.notify_only", user, params={"recipient": user.pk})
    assert handle.state == "succeeded" and handle.artifact is not None
    assert [(e.provider, e.state) for e in handle.effects] == [("inapp", "applied")]
    assert Attempt.objects.filter(job_id=handle.id).count() == 1


def test_run_inline__request_many_and_the_package_entry_points(make_user):
    user, other = make_user(), make_user()
    with jobs.testing.run_inline():
        handles = jobs.request_many(
            [
                {"kind": "test.notify_only", "subject": u, "params": {"recipient": u.pk}}
                for u in (user, other)
            ]
        )
    assert [h.state for h in handles] == ["succeeded", "succeeded"]


def test_run_inline__nests_and_restores_the_entry_points():
    request, request_many = jobs.api.request, jobs.api.request_many
    with jobs.testing.run_inline():
        wrapped = jobs.api.request
        assert wrapped is not request and jobs.request is wrapped
        with jobs.testing.run_inline():
            assert jobs.api.request is wrapped
        assert jobs.api.request is wrapped
    assert (jobs.api.request, jobs.api.request_many) == (request, request_many)
    assert (jobs.request, jobs.request_many) == (request, request_many)


def test_drain__runs_from_the_rows_not_the_messages(make_user):
    user = make_user()
    handle = jobs.request("test.notify_only", user, params={"recipient": user.pk})
    OrmQ.objects.all().delete()  # whatever carries the wake-up, the rows say what is due
    done = jobs.testing.drain()
    assert done.jobs == [(handle.id, "succeeded")]
    assert handle.refresh().state == "succeeded"
    assert jobs.testing.drain().jobs == []  # nothing due any more


def test_drain__a_job_held_by_a_live_worker_is_not_taken(make_user):
    """The claim's fence holds in the testing mode too: a leased job is another worker's."""
    user = make_user()
    handle = jobs.request("test.notify_only", user, params={"recipient": user.pk})
    assert claim_for(handle.id, "elsewhere").won
    assert not jobs.testing.drain()
    job = Job.objects.get(pk=handle.id)
    assert (job.state, job.lease_owner, job.attempts) == ("running", "elsewhere", 1)


def test_drain__an_expired_lease_is_reclaimed_as_a_worker_would(make_user):
    user = make_user()
    handle = jobs.request("test.notify_only", user, params={"recipient": user.pk})
    assert claim_for(handle.id, "crashed-worker").won
    expire_lease(handle.job)
    jobs.testing.drain()
    assert handle.refresh().state == "succeeded"
    assert handle.job.attempts == 2 and handle.job.lease_owner != "crashed-worker"


def test_drain__a_retry_waits_for_its_due_time(make_user):
    user = make_user()
    handle = jobs.request("test.short", user, params={"fail": {"1": "temporary"}})
    assert jobs.testing.drain().jobs == [(handle.id, "retry")]
    assert [h.id for h in jobs.testing.requested("test.short", state="retry_wait")] == [handle.id]
    make_due(handle.job)
    jobs.testing.drain()
    assert handle.refresh().state == "succeeded" and handle.job.attempts == 2


def test_drain__a_permanent_failure_runs_once(make_user):
    user = make_user()
    handle = jobs.request("test.short", user, params={"fail": {"always": "validation"}})
    jobs.testing.drain()
    assert handle.refresh().state == "failed" and handle.job.attempts == 1
    assert handle.error.error_class == "validation"


def test_drain__the_release_check_still_applies(make_user):
    user = make_user()
    handle = jobs.request("test.release_check_raises", user, params={"recipient": user.pk})
    jobs.testing.drain()
    effect = Effect.objects.get(job_id=handle.id)
    assert effect.state != "applied"  # the kind's release check raised: never sent


def _asks_for_a_child(ctx):
    assert jobs.testing.mode._draining  # the handler runs inside drain()
    jobs.request("test.notify_only", ("child-of", ctx.job.pk), params={"recipient": "1"})
    return []


def test_run_inline__a_job_a_handler_asks_for_runs_after_that_delivery(make_user):
    registry.register_kind("test.testing_mode.parent", _asks_for_a_child)
    user = make_user()
    with jobs.testing.run_inline():
        parent = jobs.request("test.testing_mode.parent", user)
    (child,) = jobs.testing.requested("test.notify_only")
    assert (parent.state, child.state) == ("succeeded", "succeeded")
    started = {
        a.job_id: a.started_at for a in Attempt.objects.filter(job_id__in=[parent.id, child.id])
    }
    assert started[parent.id] <= started[child.id]


def _asks_for_itself(ctx):
    jobs.request(ctx.job.kind, ("loop", 1), revision=ctx.job.output_revision + 1)
    return []


def test_drain__stops_at_its_limit_when_a_kind_keeps_asking():
    registry.register_kind("test.testing_mode.loop", _asks_for_itself)
    jobs.request("test.testing_mode.loop", ("loop", 1))
    with pytest.raises(jobs.testing.DrainLimitReached, match="still due"):
        jobs.testing.drain(limit=5)
    assert len(jobs.testing.requested("test.testing_mode.loop", state="succeeded")) == 5


def test_effects__filters(make_user):
    user = make_user()
    with jobs.testing.run_inline():
        jobs.request("test.notify_only", user, params={"recipient": user.pk})
    assert len(jobs.testing.effects(recipient=user.pk, provider="inapp", state="applied")) == 1
    assert jobs.testing.effects("test.notify_only", name="no-such-effect") == []
    assert len(jobs.testing.requested(subject=user)) == 1


def test_testing_mode__not_in_the_engine_import_graph():
    """``jobs.testing`` stays out of what the engine imports (tests/jobs/test_imports.py
    checks the source); importing the package does not load the mode either."""
    import subprocess
    import sys

    code = "import jobs.testing, sys; print('jobs.testing.mode' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
