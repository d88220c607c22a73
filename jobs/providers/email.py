"""E-mail notices through Django's mail backend (``EMAIL_BACKEND``).

SMTP has no idempotency key: once the message was handed to the server, a
timeout or a dropped connection leaves us not knowing whether it will be
delivered, and a resend may deliver it twice. Such an effect goes to
``needs_review`` (``supports_idempotency = False``); an operator marks it sent
or sends it again from the admin, and both actions are recorded.

What can be classified safely: a server we could not connect to (transport:
nothing was handed over), refused credentials (authorization: needs review) and
refused recipients or sender (validation: failed).

The address is looked up at send time from the recipient reference; the
message says only that a result is ready and where to find it (templates
``jobs/notice_subject.txt`` and ``jobs/notice_body.txt``, overridable). The
``Message-ID`` is derived from the idempotency key, so a mail client that
deduplicates by it shows an operator's resend once.

A sender that died mid-send leaves the effect ``sending``; when its lease
expires the ledger moves it to ``needs_review`` instead of sending again.

Settings: Django's ``EMAIL_*`` (``EMAIL_TIMEOUT`` bounds each SMTP step; when it
is unset, ``NOTICE_EMAIL_TIMEOUT``, default 10 s, is used),
``DEFAULT_FROM_EMAIL``, ``NOTICE_EMAIL_MAX_IN_FLIGHT`` (default 2).
"""

from __future__ import annotations

import contextlib
import smtplib
from typing import TYPE_CHECKING

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.checks import Warning
from django.core.mail import EmailMessage, get_connection
from django.core.mail.message import DNS_NAME
from django.template.loader import render_to_string

from jobs import artifacts, conf
from jobs.providers import (
    Provider,
    ProviderRefusedCredentials,
    ProviderRejected,
    ProviderTimeout,
    ProviderUnreachable,
)

if TYPE_CHECKING:
    from jobs.models import Effect


def send_timeout() -> float:
    """Seconds per SMTP step: Django's EMAIL_TIMEOUT, else NOTICE_EMAIL_TIMEOUT."""
    return float(getattr(settings, "EMAIL_TIMEOUT", None) or conf.get("NOTICE_EMAIL_TIMEOUT"))


class EmailProvider(Provider):
    """Notices by e-mail; no idempotency, so an unanswered hand-over needs review."""

    name = "email"
    supports_idempotency = False

    def in_flight_limit(self) -> int | None:
        limit = conf.get("NOTICE_EMAIL_MAX_IN_FLIGHT")
        return int(limit) if limit else None

    def message(self, effect: Effect, address: str) -> EmailMessage:
        """The e-mail: subject and body from the overridable notice templates."""
        job = effect.job
        context = {
            "effect": effect,
            "job": job,
            "artifact_key": str(effect.data.get("report_key") or artifacts.artifact_key(job)),
            "link": str(effect.data.get("link") or ""),
        }
        subject = " ".join(render_to_string("jobs/notice_subject.txt", context).split())
        return EmailMessage(
            subject=subject,
            body=render_to_string("jobs/notice_body.txt", context),
            to=[address],
            headers={"Message-ID": f"<{effect.idempotency_key}@{DNS_NAME}>"},
        )

    def send(self, effect: Effect) -> str:
        user = get_user_model().objects.filter(pk=effect.recipient).first()
        address = getattr(user, "email", "") if user is not None else ""
        if not address:
            raise ProviderRejected("the recipient has no e-mail address", code="no_address")
        msg = self.message(effect, address)
        # Never an unbounded SMTP wait: a send must end before its sending lease.
        timeout = send_timeout()
        connection = get_connection(fail_silently=False, timeout=timeout)
        try:
            connection.open()
        except smtplib.SMTPAuthenticationError as exc:
            raise ProviderRefusedCredentials(
                "the mail server refused our credentials", code=f"smtp_{exc.smtp_code}"
            ) from exc
        except (OSError, smtplib.SMTPException) as exc:
            # Connect, TLS or greeting failed: the message was not handed over.
            raise ProviderUnreachable(
                "could not open a mail connection", code=type(exc).__name__.lower()
            ) from exc
        try:
            sent = connection.send_messages([msg])
        except (smtplib.SMTPRecipientsRefused, smtplib.SMTPSenderRefused) as exc:
            raise ProviderRejected(
                "the mail server refused the sender or recipient", code=type(exc).__name__.lower()
            ) from exc
        except (OSError, smtplib.SMTPException) as exc:
            # The message may be with the server already: never resend on our own.
            raise ProviderTimeout(
                "no answer from the mail server after the message was handed over",
                code=type(exc).__name__.lower(),
            ) from exc
        finally:
            # Closing a broken connection tells us nothing new.
            with contextlib.suppress(Exception):
                connection.close()
        if not sent:
            raise ProviderRejected("the mail backend sent nothing", code="not_sent")
        return msg.extra_headers["Message-ID"]


def check_email_timing(app_configs=None, **kwargs):
    """An SMTP send outliving its lease ends in needs_review (never a blind resend)."""
    lease = float(conf.get("JOBS_EFFECT_LEASE_SECONDS"))
    budget = send_timeout() + float(conf.get("JOBS_PROVIDER_SLOT_WAIT_SECONDS"))
    if budget >= lease:
        return [
            Warning(
                f"EMAIL_TIMEOUT (or NOTICE_EMAIL_TIMEOUT) + JOBS_PROVIDER_SLOT_WAIT_SECONDS "
                f"({budget:g}) is not below JOBS_EFFECT_LEASE_SECONDS ({lease:g})",
                hint="A slow mail server then outlives the sending lease and the e-mail "
                "goes to needs_review for an operator.",
                id="jobs.W012",
            )
        ]
    return []
