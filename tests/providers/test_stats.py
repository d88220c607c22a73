"""``jobs_stats``: effects and sends per provider, counted apart."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from jobs.models import Effect
from jobs.tasks import release_effect
from tests.jobs.helpers import deliver as run_delivery
from tests.providers.conftest import notify_job

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("lookup", [False, True])
def test_jobs_stats__per_provider_resends_and_duplicate_effects_apart(
    make_user, webhook, settings, lookup
):
    settings.NOTICE_PROVIDER_LOOKUP = lookup  # with it, the unknown outcome is looked up
    user = make_user()
    webhook.faults.stall = 1.0
    stalled = notify_job(user, subject=1)
    run_delivery(stalled.pk, worker="w1")  # applied at the provider, no answer: unknown
    webhook.faults.stall = 0.0
    effect = Effect.objects.get(job=stalled)
    Effect.objects.filter(pk=effect.pk).update(
        next_attempt_at=timezone.now() - timedelta(seconds=1)
    )
    assert release_effect(effect.pk) == "applied"  # the same key again, or a lookup
    run_delivery(notify_job(user, subject=2, provider="inapp").pk, worker="w1")
    run_delivery(stalled.pk, worker="w2")  # a duplicate delivery of the finished job

    out = StringIO()
    call_command("jobs_stats", "--json", stdout=out)
    stats = json.loads(out.getvalue())
    assert stats["duplicate_deliveries"] == 1
    assert stats["duplicate_effects"] == 0
    webhook_row = stats["providers"]["webhook"]
    assert webhook_row["effects"] == 1 and webhook_row["by_state"] == {"applied": 1}
    sends = (webhook_row["sends"], webhook_row["resends"], webhook_row["lookups"])
    assert sends == ((1, 0, 1) if lookup else (2, 1, 0))
    assert webhook_row["duplicate_effects"] == 0
    assert stats["providers"]["inapp"]["sends"] == 1
    assert len(webhook.record.sends()) == 1, "one effect at the provider"

    text = StringIO()
    call_command("jobs_stats", stdout=text)
    assert "per provider" in text.getvalue() and "webhook" in text.getvalue()
