"""The public API: ``@jobs.kind``, ``jobs.request`` and its handle, ``EffectSpec`` validation."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from django_q.models import OrmQ

import jobs
from jobs import registry
from jobs.delivery.runner import run_claim, run_delivery
from jobs.models import Attempt, Job, Notice
from tests.jobs.helpers import claim_next
from tests.jobs.test_imports import JOBS

pytestmark = pytest.mark.django_db


def test_import__jobs_is_safe_before_settings_are_configured():
    code = "import jobs; print(len(jobs.__all__), 'request' in dir(jobs))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=JOBS.parent,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == [str(len(jobs.__all__)), "True"]


def test_kind__jobkinds_module_is_autodiscovered():
    declared = registry.get_kind("test.declared")
    assert declared.handler.__module__ == "tests.testapp.jobkinds"
    assert declared.max_attempts == 2


def test_kind__a_second_function_under_the_same_name_is_refused():
    with pytest.raises(ImproperlyConfigured, match="declared twice"):

        @jobs.kind("test.declared")
        def impostor(ctx):
            return []


def test_request__idempotent_handle_follows_the_job_to_its_outcome(make_user):
    user = make_user()
    first = jobs.request("test.declared", user, revision=3, params={"recipient": str(user.pk)})
    again = jobs.request("test.declared", user, revision=3, params={"recipient": str(user.pk)})
    assert (first.id, first.created, again.id, again.created) == (first.id, True, first.id, False)
    assert (first.job.subject_type, first.job.subject_id) == ("auth.user", str(user.pk))
    assert first.state == "queued" and not first.is_finished and first.artifact is None
    assert first.error is None and first.effects == []

    run_delivery(first.id, worker="w1")

    assert first.refresh().state == "succeeded" and first.is_finished
    assert first.artifact.key and first.artifact.size > 0
    [effect] = first.effects
    assert (effect.name, effect.state) == ("done-notice", "applied")
    assert Notice.objects.filter(effect=effect, recipient=user).count() == 1
    assert first.wait(timeout=1) is first


def test_request__other_params_for_an_existing_identity_raise(make_user):
    user = make_user()
    someone_else = str(user.pk + 1)  # not a fixed id: the user's own pk can be any number
    jobs.request("test.declared", ("billing.order", 7), params={"recipient": str(user.pk)})
    with pytest.raises(jobs.JobConflict, match=r"other params \(keys differing: recipient"):
        jobs.request("test.declared", ("billing.order", 7), params={"recipient": someone_else})
    # A new revision is a new job, with its own params.
    other = jobs.request(
        "test.declared", ("billing.order", 7), revision=2, params={"recipient": someone_else}
    )
    assert other.created
    assert Job.objects.count() == 2


def test_request__bad_subject_and_params_are_refused_before_anything_is_written():
    with pytest.raises(TypeError, match="model instance or a \\(type, id\\) pair"):
        jobs.request("test.declared", 7)
    with pytest.raises(jobs.PayloadInvalid, match="JSON-serialisable"):
        jobs.request("test.declared", ("a.b", 1), params={"when": timezone.now().date()})
    assert Job.objects.count() == 0


def test_request__run_after_waits_on_its_row_and_is_claimed_once_due(make_user):
    """No message at any time: the job's due time on its row is when a claim takes it."""
    user = make_user()
    later = timezone.now() + timedelta(minutes=5)
    handle = jobs.request(
        "test.declared", user, params={"recipient": str(user.pk)}, run_after=later
    )
    assert handle.job.next_attempt_at == later and handle.job.state == Job.State.QUEUED
    assert not OrmQ.objects.exists()
    assert claim_next() is None, "not due before run_after"
    assert run_delivery(handle.id, worker="early").outcome == "duplicate"  # asked by name early

    # Due a second ago: SQLite's clock (Django's Now()) has milliseconds, Python's
    # microseconds, so "now" written from here can be ahead of the claim's "now".
    Job.objects.filter(pk=handle.id).update(next_attempt_at=timezone.now() - timedelta(seconds=1))
    claim = claim_next(worker="w1")
    assert claim.won and claim.job.pk == handle.id
    assert not OrmQ.objects.exists()
    assert run_claim(claim, "w1").outcome == "succeeded"


def test_effectspec__an_address_as_recipient_fails_the_job_once_as_validation(make_user):
    make_user(email="someone@example.com")
    handle = jobs.request("test.declared", ("a.b", 1), params={"recipient": "someone@example.com"})

    result = run_delivery(handle.id, worker="w1")

    handle.refresh()
    assert (result.outcome, handle.state, handle.job.attempts) == ("failed", "failed", 1)
    assert handle.error.error_class == "validation"
    assert handle.error.code == "payload_invalid"
    assert "recipient must be a user id" in handle.error.detail
    assert "someone@example.com" not in handle.error.detail  # the reason names no address
    assert handle.effects == []
    assert list(Attempt.objects.filter(job=handle.job).values_list("outcome", flat=True)) == [
        "failed"
    ]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (jobs.EffectSpec("", "inapp", "1"), "name must be a non-empty string"),
        (jobs.EffectSpec("n", "pigeon", "1"), "provider 'pigeon' is not registered"),
        (jobs.EffectSpec("n", "inapp", ""), "recipient must be a user id"),
        (jobs.EffectSpec("n", "inapp", "1", data=[1]), "data must be a dict"),
        (jobs.EffectSpec("n", "inapp", "1", data={"at": object()}), "JSON-serialisable"),
    ],
)
def test_effectspec_validate__names_what_is_wrong(spec, reason):
    with pytest.raises(jobs.PayloadInvalid, match=reason):
        spec.validate()


def test_effectspec_validate__a_user_id_passes():
    jobs.EffectSpec("n", "inapp", "17", {"title": "t"}).validate()
    jobs.EffectSpec("n", "inapp", 17).validate()
