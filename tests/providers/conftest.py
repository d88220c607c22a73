"""The stand-in provider on loopback, webhook settings pointing at it, a notifying kind."""

from __future__ import annotations

import time

import pytest

from jobs.registry import EffectSpec, register_kind
from jobs.testing.fakeprovider import Faults, start_in_thread
from tests.jobs.helpers import request_job

TOKEN = "test-token-0123"


def notify(ctx) -> list[EffectSpec]:
    """Store a small artifact and notify params.recipient through params.provider."""
    ctx.check_owner()
    artifact = ctx.store_artifact(
        f"report of job {ctx.job.pk}\n".encode(), content_type="text/plain", extension="txt"
    )
    data = {"report_key": artifact.key, "title": "Report for applicant Jane Roe, 555-0100"}
    return [
        EffectSpec("completion-notice", ctx.params["provider"], str(ctx.params["recipient"]), data)
    ]


register_kind("test.notify", notify)


def notify_job(user, *, provider="webhook", subject=None, revision=1):
    job, _ = request_job(
        "test.notify",
        subject_type="auth.user",
        subject_id=subject if subject is not None else user.pk,
        output_revision=revision,
        params={"recipient": user.pk, "provider": provider},
    )
    return job


def wait_for(predicate, *, timeout: float = 10.0, what: str = "a condition"):
    """Poll until ``predicate()`` is truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def provider(tmp_path):
    """The stand-in provider in a thread on an ephemeral loopback port (its own record)."""
    server = start_in_thread(tmp_path / "provider.sqlite3", token=TOKEN, faults=Faults(seed=4))
    yield server
    server.stop()


@pytest.fixture
def webhook(settings, provider):
    """Point the webhook provider at the stand-in with short timeouts."""
    settings.NOTICE_PROVIDER_URL = provider.url
    settings.NOTICE_PROVIDER_TOKEN = TOKEN
    settings.NOTICE_PROVIDER_CONNECT_TIMEOUT = 0.5
    settings.NOTICE_PROVIDER_READ_TIMEOUT = 0.5
    settings.NOTICE_PROVIDER_MAX_IN_FLIGHT = 4
    settings.JOBS_PROVIDER_SLOT_WAIT_SECONDS = 0.5
    # A send's lease outlives the send on a loaded machine (slot wait, connect, read and
    # the ledger's writes took 2.5 s in a CI run): a lost lease there is not the test's
    # subject. A test of a lost lease moves ``lease_expires_at`` itself.
    settings.JOBS_EFFECT_LEASE_SECONDS = 30
    return provider


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a ``manage.py`` child that must see this test's database."""
    import os

    from django.conf import settings

    db = settings.DATABASES["default"]
    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    if db["ENGINE"].endswith("postgresql"):
        from jobs.testing.scratchdb import url_from_settings

        env["DATABASE_URL"] = url_from_settings(db)
    env.pop("TEST_DATABASE_NAME", None)
    env.update(extra)
    return env
