"""The redrive drill of issue 43's acceptance, against the stand-in provider on loopback.

200 notices stopped by a provider outage, 50 of them applied at the provider after all
(the answers lost); ``jobs_redrive --dry-run`` prints the counts, one console redrive of
the group finds the 50 by lookup without a send and makes the 150 due; eight worker
threads release them under the provider's in-flight bound: each sent once, 0 duplicate
effects, and one audit record with the counts.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import call_command
from django.db import connections
from django.urls import reverse

from jobs import stats
from jobs.models import Effect
from jobs.ops import redrive
from jobs.testing.queue import run_queued_effects
from tests.jobs.ops.test_redrive import operator, outage_effects, successful_posts
from tests.providers.conftest import provider, webhook  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres,
    pytest.mark.drill,
    pytest.mark.urls("tests.testapp.urls"),
]

State = Effect.State
GROUP = {
    "target": "effect",
    "kind": "test.notify",
    "state": State.NEEDS_REVIEW,
    "error_class": "transport",
    "provider": "webhook",
}


def release_in_threads(n: int) -> None:
    """``n`` workers releasing due effects at once until none is left."""
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(200):
                if not run_queued_effects(f"drill-{i}") and not due():
                    return
        except BaseException as exc:  # the test fails with it below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


def due() -> bool:
    return Effect.objects.filter(state__in=[State.PENDING, State.SENDING]).exists()


def test_redrive_drill__200_stuck_50_applied_one_console_redrive(
    make_user,
    webhook,  # noqa: F811
    client,
    capsys,
):
    effects = outage_effects(make_user, webhook, 200, applied=50)
    applied_keys = {e.idempotency_key for e in effects[:50]}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in GROUP.items()]
    call_command("jobs_redrive", *flags, "--dry-run", "--json")
    dry = json.loads(capsys.readouterr().out)

    client.force_login(operator(make_user))
    confirm = client.get(reverse("admin:jobs_job_redrive_confirm"), GROUP)
    assert "Redrive 200 effects?" in confirm.content.decode()
    webhook.faults.delay = 0.02  # calls overlap: the bound has something to hold
    began = time.time()
    client.post(reverse("admin:jobs_job_redrive_confirm"), GROUP)
    release_in_threads(8)

    (entry,) = LogEntry.objects.filter(change_message__startswith='{"redrive"')
    record = json.loads(entry.change_message)["redrive"]
    counts = {k: record[k] for k in ("matched", "redriven", "found_applied", "skipped")}
    assert counts == {"matched": 200, "redriven": 150, "found_applied": 50, "skipped": 0}
    assert {k: dry[k] for k in counts} == counts, "the dry run printed the same counts"
    states = set(Effect.objects.filter(provider="webhook").values_list("state", flat=True))
    assert states == {State.APPLIED}
    for effect in effects:
        assert successful_posts(webhook, effect) == [201], "applied once, never sent twice"
    lookups = {r["idempotency_key"] for r in webhook.record.lookups()}
    assert applied_keys <= lookups
    bound = 4  # NOTICE_PROVIDER_MAX_IN_FLIGHT (the webhook fixture)
    peak = webhook.record.max_in_flight(since=began)
    assert 1 <= peak <= bound, f"{peak} calls in flight at once"
    assert webhook.record.duplicate_effects() == {}
    assert stats.collect()["duplicate_effects"] == 0
    print(f"redrive drill: {counts} dry run {dry} peak in flight {peak} of {bound}")


def test_redrive_drill__the_cap_leaves_the_rest_for_the_next_redrive(make_user, settings):
    from tests.jobs.ops.test_redrive import inapp_effects, stuck

    settings.JOBS_REDRIVE_MAX = 4
    stuck(inapp_effects(make_user, 6))
    group = redrive.Filter("effect", "test.steps", State.NEEDS_REVIEW, "transport", "inapp")
    first = redrive.redrive(group, operator="op", user_id=make_user().pk)
    second = redrive.redrive(group, operator="op", user_id=make_user().pk)
    assert (first.redriven, first.left, second.redriven, second.left) == (4, 2, 2, 0)
