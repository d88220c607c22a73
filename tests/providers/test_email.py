"""The e-mail provider through Django's mail backend, and the operator's two answers."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.core import mail
from django.urls import reverse
from django.utils import timezone

from jobs.engine import effect_machine
from jobs.models import Effect, EffectEvent
from jobs.tasks import release_effect
from tests.jobs.helpers import deliver as run_delivery
from tests.jobs.helpers import releasable_effects, run_queued_effects
from tests.providers.conftest import notify_job

pytestmark = pytest.mark.django_db

State = Effect.State


class StallingSMTP:
    """A loopback SMTP server that takes a whole message and then never confirms it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.messages = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn):
        with conn, conn.makefile("rwb") as f:

            def say(line: str) -> None:
                f.write(line.encode() + b"\r\n")
                f.flush()

            say("220 stall.test ESMTP")
            while line := f.readline():
                verb = line[:4].upper()
                if verb in (b"EHLO", b"HELO"):
                    say("250 stall.test")
                elif verb in (b"MAIL", b"RCPT", b"RSET", b"NOOP"):
                    say("250 OK")
                elif verb == b"DATA":
                    say("354 go ahead")
                    while f.readline() not in (b".\r\n", b""):
                        pass
                    self.messages += 1
                    self.stop.wait(30)  # taken, never confirmed
                    return
                elif verb == b"QUIT":
                    say("221 bye")
                    return

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.fixture
def smtp(settings):
    server = StallingSMTP()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = server.port
    settings.EMAIL_TIMEOUT = 0.5
    yield server
    server.close()


def effect_of(job) -> Effect:
    return Effect.objects.select_related("job").get(job=job)


def test_email__sent_once_through_the_mail_backend(make_user):
    user = make_user(email="reviewer@example.org")
    job = notify_job(user, provider="email")
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.APPLIED
    (message,) = mail.outbox
    assert message.to == ["reviewer@example.org"]
    assert message.extra_headers["Message-ID"].startswith(f"<{effect.idempotency_key}@")
    assert effect.provider_ref == message.extra_headers["Message-ID"]
    assert f"job-{job.uid}-rev-1" in message.body
    assert "Jane" not in message.body and "555" not in message.body, "references only"
    assert release_effect(effect.pk) == "skipped"
    assert len(mail.outbox) == 1


def test_email__timeout_after_the_handover_needs_review_and_is_never_resent(make_user, smtp):
    user = make_user(email="reviewer@example.org")
    job = notify_job(user, provider="email")
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.NEEDS_REVIEW
    assert effect.last_error_class == "provider_timeout"
    assert "cannot deduplicate" in effect.reason
    assert smtp.messages == 1, "the server has the message"
    Effect.objects.filter(pk=effect.pk).update(
        next_attempt_at=timezone.now() - timedelta(seconds=1)
    )
    assert releasable_effects() == [], "no automatic resend"
    assert release_effect(effect.pk) == "skipped"
    assert smtp.messages == 1


def test_email__unreachable_server_is_transport_and_retried(make_user, settings):
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", port, 0.5
    user = make_user(email="reviewer@example.org")
    job = notify_job(user, provider="email")
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.PENDING, "nothing was handed over: safe to retry"
    assert effect.last_error_class == "transport"
    assert effect.next_attempt_at > timezone.now()


def test_email__recipient_without_an_address_fails_once(make_user):
    user = make_user(email="")
    job = notify_job(user, provider="email")
    run_delivery(job.pk, worker="w1")
    effect = effect_of(job)
    assert effect.state == State.FAILED and effect.last_error_code == "no_address"
    assert mail.outbox == []


def test_email_admin__operator_marks_sent_or_sends_again_and_each_is_recorded(
    make_user, smtp, admin_client, settings
):
    user = make_user(email="reviewer@example.org")
    kept = effect_of(run_job(notify_job(user, provider="email", subject=1)))
    resent = effect_of(run_job(notify_job(user, provider="email", subject=2)))
    assert kept.state == resent.state == State.NEEDS_REVIEW
    assert smtp.messages == 2

    changelist = reverse("admin:jobs_effect_changelist")
    page = admin_client.get(changelist)
    assert page.status_code == 200
    summary = page.content.decode().split('id="provider-summary"')[1].split("</table>")[0]
    assert "Being checked" in summary and "needs review</span></span> 2" in summary

    answer = admin_client.post(
        changelist, {"action": "mark_sent", "_selected_action": [kept.pk], "confirmed": "yes"}
    )
    assert answer.status_code == 302
    kept.refresh_from_db()
    assert kept.state == State.APPLIED and "admin" in kept.reason

    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"  # server fixed
    admin_client.post(
        changelist, {"action": "send_again", "_selected_action": [resent.pk], "confirmed": "yes"}
    )
    resent.refresh_from_db()
    assert resent.state == State.PENDING and mail.outbox == [], "the request only enqueues"
    # Each bulk action: one entry per effect changed and one summary (no object).
    summaries = LogEntry.objects.filter(object_id=None).order_by("id")
    assert [s.object_repr for s in summaries] == [
        "Bulk mark sent: 1 effect",
        "Bulk send again: 1 effect",
    ]
    assert LogEntry.objects.exclude(object_id=None).count() == 2
    run_queued_effects()  # a worker sends
    resent.refresh_from_db()
    assert resent.state == State.APPLIED and len(mail.outbox) == 1
    assert resent.attempts == 2

    def history(effect):
        return list(
            EffectEvent.objects.filter(effect=effect)
            .order_by("id")
            .values_list("action", "actor", "outcome")
        )

    worker = history(kept)[0][1]
    assert history(kept) == [
        ("claim", worker, "sending"),
        ("send", worker, "needs_review"),
        ("mark_sent", "operator:admin", "applied"),
    ]
    assert [(a, o) for a, _, o in history(resent)] == [
        ("claim", "sending"),
        ("send", "needs_review"),
        ("send_again", "pending"),
        ("claim", "sending"),
        ("send", "applied"),
    ]
    assert history(resent)[2][1] == "operator:admin"

    # Neither action applies twice or to a settled effect.
    admin_client.post(
        changelist, {"action": "mark_sent", "_selected_action": [kept.pk], "confirmed": "yes"}
    )
    admin_client.post(
        changelist, {"action": "send_again", "_selected_action": [resent.pk], "confirmed": "yes"}
    )
    run_queued_effects()
    assert EffectEvent.objects.count() == 8 and len(mail.outbox) == 1
    detail = admin_client.get(reverse("admin:jobs_effect_change", args=[resent.pk]))
    assert detail.status_code == 200 and b"send_again" in detail.content


def run_job(job):
    run_delivery(job.pk, worker="w1")
    return job


def test_email__sender_lost_mid_send_goes_to_review_instead_of_a_blind_resend(make_user):
    from tests.jobs.helpers import Crash

    user = make_user(email="reviewer@example.org")
    job = notify_job(user, provider="email")

    def die_after_publish(stage, ctx):
        if stage == "published":
            raise Crash

    with pytest.raises(Crash):
        run_delivery(job.pk, worker="w1", on_stage=die_after_publish)
    effect = effect_of(job)
    assert effect_machine.claim_send(effect, "w1") == "claimed"  # then dies inside the SMTP call
    Effect.objects.filter(pk=effect.pk).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    assert releasable_effects(job=job) == [effect.pk], "due again on the ledger"
    assert release_effect(effect.pk) == "needs_review"
    effect.refresh_from_db()
    assert effect.last_error_code == "sender_lost" and "may have arrived" in effect.reason
    assert mail.outbox == [], "nothing sent on a guess"
    assert releasable_effects() == []
