"""Effect-aware redrive (issue 43): groups and counts, lookups first, operators only."""

from __future__ import annotations

import json

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from jobs import registry
from jobs.models import Effect, FlowRule, Job, Notice
from jobs.ops import redrive
from jobs.testing.queue import run_queued_effects
from tests.jobs.helpers import deliver, new_job
from tests.providers.conftest import notify_job, provider, webhook  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.testapp.urls")]

State = Effect.State


def stuck(effects, state=State.NEEDS_REVIEW, error_class="transport") -> None:
    """What an outage leaves: the effects stopped for an operator (their budget spent),
    never applied (an in-app notice's row is removed with its apply)."""
    Notice.objects.filter(effect__in=[e.pk for e in effects]).delete()
    Effect.objects.filter(pk__in=[e.pk for e in effects]).update(
        state=state,
        last_error_class=error_class,
        next_attempt_at=None,
        lease_expires_at=None,
        lease_owner="",
    )


def inapp_effects(make_user, n: int, *, kind="test.steps") -> list[Effect]:
    user = make_user()
    for i in range(n):
        deliver(new_job(user, kind=kind, subject=1000 + i).pk)
    return list(Effect.objects.filter(job__kind=kind).order_by("pk"))


def operator(make_user, *, perms=("change_job", "change_effect", "view_job")):
    user = make_user(is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="jobs", codename__in=perms)
    )
    return user


# --- groups and counts ------------------------------------------------------------------


def test_redrive_groups__by_kind_provider_error_class_and_state(make_user):
    effects = inapp_effects(make_user, 5)
    stuck(effects[:3])
    stuck(effects[3:4], state=State.FAILED, error_class="validation")
    dead = new_job(make_user(), subject=77)
    Job.objects.filter(pk=dead.pk).update(state=Job.State.DEAD, last_error_class="unknown")

    found = {g.filter.words(): g.count for g in redrive.groups()}

    assert found == {
        "effects kind=test.steps provider=inapp error_class=transport state=needs_review": 3,
        "effects kind=test.steps provider=inapp error_class=validation state=failed": 1,
        "jobs kind=test.steps error_class=unknown state=dead": 1,
    }
    assert [g.count for g in redrive.groups()] == [3, 1, 1], "largest first"


def test_redrive_filter__refuses_a_state_a_redrive_does_not_start_from():
    with pytest.raises(redrive.RedriveError):
        redrive.Filter("effect", "k", "applied", "", "inapp")
    with pytest.raises(redrive.RedriveError):
        redrive.Filter("job", "k", "dead", "", "inapp")
    with pytest.raises(redrive.RedriveError):
        redrive.Filter("effect", "k", "failed", "", "")


def test_redrive__is_capped_and_skips_what_the_ledger_moved(make_user, settings):
    settings.JOBS_REDRIVE_MAX = 3
    effects = inapp_effects(make_user, 5)
    stuck(effects)
    group = redrive.Filter("effect", "test.steps", State.NEEDS_REVIEW, "transport", "inapp")
    rows = list(group.rows())
    # Between the count and the redrive an operator marks the oldest sent by hand.
    from jobs.engine import effect_machine

    real = effect_machine.redrive

    def marked_first(effect, **kw):
        if effect.pk == rows[0].pk:
            effect_machine.mark_sent(Effect.objects.get(pk=effect.pk), operator="other")
        return real(effect, **kw)

    effect_machine.redrive = marked_first
    try:
        result = redrive.redrive(group, operator="op", user_id=make_user().pk)
    finally:
        effect_machine.redrive = real
    assert result.counts() == {
        "matched": 5,
        "taken": 3,
        "redriven": 2,
        "skipped": 1,
        "found_applied": 0,
        "unanswered": 0,
        "left": 2,
    }
    states = dict(Effect.objects.filter(pk__in=[e.pk for e in rows]).values_list("pk", "state"))
    assert [states[e.pk] for e in rows] == [
        State.APPLIED,
        State.PENDING,
        State.PENDING,
        *([State.NEEDS_REVIEW] * 2),
    ]
    # The redriven ones are due through the ledger's claim: a worker applies them.
    run_queued_effects()
    assert Effect.objects.filter(state=State.APPLIED).count() == 3


def test_redrive__dead_jobs_are_requeued_and_audited(make_user):
    job = new_job(make_user(), subject=5)
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.DEAD, last_error_class="unknown", last_error_code="RuntimeError"
    )
    user = make_user(username="ops1")
    group = redrive.Filter("job", "test.steps", "dead", "unknown")

    result = redrive.redrive(group, operator="ops1", user_id=user.pk)

    assert (result.redriven, result.skipped) == (1, 0)
    assert Job.objects.get(pk=job.pk).state == Job.State.QUEUED
    entry = LogEntry.objects.get(pk=result.audit_id)
    record = json.loads(entry.change_message)["redrive"]
    assert entry.user_id == user.pk and record["by"] == "ops1"
    assert record["filter"]["kind"] == "test.steps" and record["redriven"] == 1


# --- the stand-in provider: some effects already applied there ------------------------------


def outage_effects(make_user, webhook, n: int, applied: int) -> list[Effect]:  # noqa: F811
    """``n`` webhook notices a provider outage stopped (503 each, nothing landed), of which
    ``applied`` did land after all (sent straight to the provider, the answer lost), then
    stopped for review, as a spent budget leaves them."""
    webhook.faults.unavailable, webhook.faults.retry_after = 1.0, 0
    user = make_user()
    for i in range(n):
        deliver(notify_job(user, subject=5000 + i).pk)
    webhook.faults.unavailable = 0.0
    # The outage is over: the provider's circuit closed again.
    FlowRule.objects.filter(scope="provider:webhook").update(
        circuit_state="closed", circuit_failures=0
    )
    effects = list(Effect.objects.filter(provider="webhook").select_related("job").order_by("pk"))
    send = registry.get_provider("webhook").send
    for effect in effects[:applied]:
        send(effect)  # applied at the provider; the ledger never heard
    stuck(effects)
    return effects


def successful_posts(webhook, effect) -> list[int]:  # noqa: F811
    return [
        r["status"]
        for r in webhook.record.requests_for(effect.idempotency_key)
        if r["status"] in (200, 201)
    ]


@pytest.mark.postgres
def test_redrive__found_applied_by_lookup_is_not_sent_again(make_user, webhook):  # noqa: F811
    effects = outage_effects(make_user, webhook, 6, applied=2)
    group = redrive.Filter("effect", "test.notify", State.NEEDS_REVIEW, "transport", "webhook")

    dry = redrive.redrive(group, operator="op", dry_run=True)
    assert Effect.objects.filter(state=State.NEEDS_REVIEW).count() == 6, "a dry run writes nothing"
    result = redrive.redrive(group, operator="op", user_id=make_user().pk)
    run_queued_effects()

    assert (dry.found_applied, dry.redriven) == (result.found_applied, result.redriven) == (2, 4)
    for effect in effects:
        effect.refresh_from_db()
        assert effect.state == State.APPLIED
        assert successful_posts(webhook, effect) == [201], "applied once, never re-sent"
    found = effects[0].events.order_by("id").last()
    assert (found.action, found.error_code, found.outcome) == ("lookup", "found", State.APPLIED)
    assert found.actor == "operator:op"
    assert webhook.record.duplicate_effects() == {}


# --- the console: operators only, CSRF, a confirmation naming the count ----------------------


def _confirm_url(group: redrive.Filter) -> str:
    query = "&".join(
        f"{k}={getattr(group, k)}" for k in ("target", "kind", "state", "error_class", "provider")
    )
    return f"{reverse('admin:jobs_job_redrive_confirm')}?{query}"


def test_redrive_console__lists_groups_and_confirms_with_the_count(client, make_user):
    stuck(inapp_effects(make_user, 3))
    client.force_login(operator(make_user))
    page = client.get(reverse("admin:jobs_job_redrive")).content.decode()
    assert "test.steps" in page and "Redrive…" in page
    group = redrive.Filter("effect", "test.steps", State.NEEDS_REVIEW, "transport", "inapp")
    confirm = client.get(_confirm_url(group))
    assert confirm.status_code == 200
    assert "Redrive 3 effects?" in confirm.content.decode()
    fields = {k: getattr(group, k) for k in ("target", "kind", "state", "error_class", "provider")}
    done = client.post(reverse("admin:jobs_job_redrive_confirm"), fields, follow=True)
    assert done.status_code == 200 and "3 redriven" in done.content.decode()
    assert Effect.objects.filter(state=State.PENDING).count() == 3
    assert "3 redriven" in client.get(reverse("admin:jobs_job_redrive")).content.decode()


def test_redrive_console__a_non_operator_gets_403(client, make_user):
    stuck(inapp_effects(make_user, 1))
    group = redrive.Filter("effect", "test.steps", State.NEEDS_REVIEW, "transport", "inapp")
    fields = {k: getattr(group, k) for k in ("target", "kind", "state", "error_class", "provider")}
    client.force_login(operator(make_user, perms=("view_job", "view_effect")))
    assert client.get(reverse("admin:jobs_job_redrive")).status_code == 200
    assert "Redrive…" not in client.get(reverse("admin:jobs_job_redrive")).content.decode()
    assert client.get(_confirm_url(group)).status_code == 403
    assert client.post(reverse("admin:jobs_job_redrive_confirm"), fields).status_code == 403
    assert Effect.objects.filter(state=State.NEEDS_REVIEW).count() == 1


def test_redrive_console__a_post_without_the_csrf_token_is_refused(make_user):
    stuck(inapp_effects(make_user, 1))
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator(make_user))
    fields = {
        "target": "effect",
        "kind": "test.steps",
        "state": State.NEEDS_REVIEW,
        "error_class": "transport",
        "provider": "inapp",
    }
    assert client.post(reverse("admin:jobs_job_redrive_confirm"), fields).status_code == 403
    assert Effect.objects.filter(state=State.NEEDS_REVIEW).count() == 1


def test_jobs_redrive__dry_run_prints_the_counts_and_changes_nothing(make_user, capsys):
    stuck(inapp_effects(make_user, 2))
    call_command(
        "jobs_redrive",
        "--kind=test.steps",
        "--provider=inapp",
        "--state=needs_review",
        "--error-class=transport",
        "--dry-run",
        "--json",
    )
    counts = json.loads(capsys.readouterr().out)
    assert counts["dry_run"] is True and (counts["matched"], counts["redriven"]) == (2, 2)
    assert Effect.objects.filter(state=State.NEEDS_REVIEW).count() == 2
