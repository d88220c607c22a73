"""After a failover lost a job, no notice goes out twice (issue 47, jobs_reconcile).

The stand-in provider on loopback is the witness: it records every POST and lookup per
key. A job publishes and its webhook notice is applied; then its rows are deleted, as a
promoted asynchronous standby never had them, while the bucket keeps its object and its
identity manifest. ``reconcile`` finds it, asks for it again under its uid, and the new
row's notice is the same effect under the same key: looked up, recorded as applied with
the provider's reference, and never POSTed a second time.
"""

from __future__ import annotations

import time

import pytest

from jobs import reconcile
from jobs.models import Artifact, Effect, Job, JobEvent
from jobs.providers.webhook import WebhookProvider
from jobs.reconcile import ask_again
from tests.jobs.helpers import deliver, lose_job, make_due, run_queued_effects
from tests.providers.conftest import notify_job

pytestmark = pytest.mark.django_db

State = Effect.State


def posts(webhook, key: str) -> int:
    return len(webhook.record.requests_for(key))


def test_reconcile__a_lost_jobs_accepted_notice_is_not_sent_again(make_user, webhook):
    user = make_user()
    job = notify_job(user)
    deliver(job.pk, worker="w-old-primary")
    sent = Effect.objects.get(job=job)
    assert sent.state == State.APPLIED and posts(webhook, sent.idempotency_key) == 1
    lose_job(job)  # the promoted standby never had it; the provider and the bucket do

    report = reconcile.reconcile()
    [lost] = report.lost
    assert lost.job == str(job.uid) and lost.manifest is not None
    assert lost.manifest.subject_id == str(user.pk) and lost.manifest.kind == "test.notify"
    assert report.providers == {"webhook": "listed 1"}
    [unknown] = report.unknown
    assert unknown.idempotency_key == sent.idempotency_key
    assert unknown.reference == sent.provider_ref and unknown.job == str(job.uid)
    what, new_id = report.outcomes[str(job.uid)]
    assert what == ask_again.REQUESTED and report.asked_again == 1

    again = Job.objects.get(pk=new_id)
    assert again.uid == job.uid, "asked again under the uid the outside world knows"
    assert again.reconciled_at is not None
    assert JobEvent.objects.filter(job=again, action="reconcile").count() == 1
    deliver(again.pk, worker="w-new-primary")
    effect = Effect.objects.get(job=again)
    assert (effect.effect_id, effect.idempotency_key) == (sent.effect_id, sent.idempotency_key)
    assert effect.state == State.APPLIED and effect.provider_ref == sent.provider_ref
    assert posts(webhook, sent.idempotency_key) == 1, "no second POST"
    assert len(webhook.record.lookups_for(sent.idempotency_key)) == 1
    assert webhook.record.duplicate_effects() == {}
    assert reconcile.reconcile().lost == [], "a second run finds nothing more"


def test_reconcile__a_lost_notice_the_provider_never_saw_goes_out_once(make_user, webhook):
    user = make_user()
    job = notify_job(user)
    from jobs.delivery.runner import run_delivery

    run_delivery(job.pk, worker="w-old-primary")  # published; the notice not sent yet
    key = Effect.objects.get(job=job).idempotency_key
    lose_job(job)
    run_queued_effects()  # its message names a row that is gone: nothing is sent

    report = reconcile.reconcile()
    assert report.unknown == [] and report.asked_again == 1
    deliver(report.outcomes[str(job.uid)][1], worker="w-new-primary")
    effect = Effect.objects.get(idempotency_key=key)
    assert effect.state == State.APPLIED
    assert posts(webhook, key) == 1 and len(webhook.record.lookups_for(key)) == 1


def test_reconcile__a_subject_that_is_gone_is_reported_not_asked_again(make_user, webhook):
    user = make_user()
    job = notify_job(user)
    deliver(job.pk, worker="w-old-primary")
    lose_job(job)
    user.delete()
    report = reconcile.reconcile()
    assert report.outcomes[str(job.uid)] == (ask_again.SUBJECT_GONE, None)
    assert not Job.objects.filter(uid=job.uid).exists()


def test_reconcile__dry_run_asks_for_nothing(make_user, webhook):
    job = notify_job(make_user())
    deliver(job.pk, worker="w-old-primary")
    lose_job(job)
    report = reconcile.reconcile(dry_run=True)
    assert report.outcomes[str(job.uid)] == (ask_again.REQUESTED, None)
    assert not Job.objects.filter(uid=job.uid).exists()


def test_reconcile__an_existing_job_that_lost_its_publish_is_looked_up_first(make_user, webhook):
    job = notify_job(make_user())
    deliver(job.pk, worker="w-old-primary")
    sent = Effect.objects.get(job=job)
    # The standby had the request, not the publish: the job waits again, no ledger row.
    Effect.objects.filter(job=job).delete()
    Artifact.objects.filter(job=job).delete()
    Job.objects.filter(pk=job.pk).update(state=Job.State.QUEUED, lease_owner="")
    report = reconcile.reconcile()
    assert report.lost == [] and report.marked == 1
    assert Job.objects.get(pk=job.pk).reconciled_at is not None
    make_due(job)
    deliver(job.pk, worker="w-new-primary")
    effect = Effect.objects.get(job=job)
    assert effect.state == State.APPLIED and effect.provider_ref == sent.provider_ref
    assert posts(webhook, sent.idempotency_key) == 1, "looked up, not sent again"


def test_webhook_accepted_since__lists_what_the_provider_applied(make_user, webhook):
    before = time.time() - 1
    deliver(notify_job(make_user()).pk, worker="w1")
    effect = Effect.objects.get()
    [accepted] = WebhookProvider().accepted_since(before)
    assert (accepted.idempotency_key, accepted.reference, accepted.effect_id) == (
        effect.idempotency_key,
        effect.provider_ref,
        effect.effect_id,
    )
    assert WebhookProvider().accepted_since(time.time() + 60) == []
    webhook.faults.no_lookup = True
    assert WebhookProvider().accepted_since(before) is None, "a provider without a listing"


def test_webhook_accepted_since__follows_the_pages(make_user, webhook, monkeypatch):
    from jobs.testing import fakeprovider

    monkeypatch.setattr(fakeprovider, "LIST_PAGE", 2)
    user = make_user()
    for subject in (1, 2, 3):
        deliver(notify_job(user, subject=subject).pk, worker="w1")
    accepted = WebhookProvider().accepted_since(0)
    assert sorted(a.idempotency_key for a in accepted) == sorted(
        Effect.objects.values_list("idempotency_key", flat=True)
    )
    listings = webhook.record.requests(path=fakeprovider.LIST_PATH)
    assert len(listings) == 2, "a full page, then the rest"
