"""The HTTP notice provider: ``POST {NOTICE_PROVIDER_URL}/notices`` with an idempotency key.

The body names references only (``effect_id``, ``recipient``, ``job``,
``revision``, ``report_key``, ``kind``, and ``link`` when the effect's data has one;
docs/app/webhooks.md is the wire contract) and is a pure function of the effect,
so a resend under the same ``Idempotency-Key`` carries the same body and the
provider answers ``200`` with the id it gave the first time.

Answers map to the retry classes (``jobs.retry``): 201/200 applied; 400/409/422
validation (failed); 401/403 authorization (needs review); 429/503 and other 5xx
temporary (``Retry-After`` honoured); a connect error is transport; a read
timeout after the request went out is a provider timeout: the effect becomes
``unknown``. Before it is sent again, ``lookup`` asks ``GET {NOTICE_PROVIDER_URL}/notices/{key}``:
``200 {"id"}`` means the provider applied it (recorded, no second POST), ``404`` that it
never saw the key (the send goes ahead with the same key).

Optional listing (issue 47, ``accepted_since``): ``GET {NOTICE_PROVIDER_URL}/notices?since=T``
(Unix seconds; ``&after=C`` for the next page) answers ``200 {"notices": [{"key", "id",
"effect_id", "applied_at"}], "next": C or null}``; ``404``/``405``: no listing.

Settings (read at call time; ``NOTICE_PROVIDER`` is the default prefix):
``NOTICE_PROVIDER_URL`` (required when used), ``NOTICE_PROVIDER_TOKEN``,
``NOTICE_PROVIDER_CONNECT_TIMEOUT`` (s), ``NOTICE_PROVIDER_READ_TIMEOUT`` (s),
``NOTICE_PROVIDER_MAX_IN_FLIGHT``, ``NOTICE_PROVIDER_LOOKUP``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING
from urllib.parse import quote

import httpx
from django.core.checks import Error, register

from jobs import artifacts, conf, retry
from jobs.providers import (
    Accepted,
    Provider,
    ProviderError,
    ProviderLookupUnsupported,
    ProviderNotConfigured,
    ProviderProtocolError,
    ProviderTimeout,
    ProviderUnreachable,
)

if TYPE_CHECKING:
    from jobs.models import Effect


class _KeyOutOfRequestLog(logging.Filter):
    """httpx logs every request's URL at INFO, and a lookup's URL ends with the
    idempotency key, which no log line may carry: the key is masked there."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(
            isinstance(a, httpx.URL) and LOOKUP_PATH in a.path for a in record.args
        ):
            record.args = tuple(
                a.copy_with(path=a.path.split(LOOKUP_PATH)[0] + LOOKUP_PATH + "{key}")
                if isinstance(a, httpx.URL)
                else a
                for a in record.args
            )
        return True


LOOKUP_PATH = "/notices/"
logging.getLogger("httpx").addFilter(_KeyOutOfRequestLog())

BODY_FIELDS = ("effect_id", "recipient", "job", "revision", "report_key", "kind")
# ``EffectSpec.data`` keys sent as they are, when present (docs/app/webhooks.md). Free
# text such as ``title`` is not sent: it may quote private data; receivers word their own.
DATA_FIELDS = ("link",)


def notice_body(effect: Effect) -> dict:
    """The protocol body: references only, the same for every send of one effect."""
    job = effect.job
    body = {
        "effect_id": effect.effect_id,
        "recipient": effect.recipient,
        "job": job.pk,
        "revision": job.output_revision,
        "report_key": str(effect.data.get("report_key") or artifacts.artifact_key(job)),
        "kind": str(effect.data.get("kind") or effect.name),
    }
    for name in DATA_FIELDS:
        if effect.data.get(name) not in (None, ""):
            body[name] = str(effect.data[name])
    return body


class WebhookProvider(Provider):
    """Notices over HTTP; the provider deduplicates by ``Idempotency-Key``."""

    supports_idempotency = True
    supports_listing = True  # discovered: a 404/405 to the listing means it has none

    def __init__(self, name: str = "webhook", *, settings_prefix: str = "NOTICE_PROVIDER"):
        self.name = name
        self.prefix = settings_prefix
        self._local = threading.local()

    def setting(self, suffix: str):
        name = f"{self.prefix}_{suffix}"
        # A second provider (another prefix) shares the documented defaults.
        value = conf.get(name, conf.DEFAULTS[f"NOTICE_PROVIDER_{suffix}"])
        if suffix == "URL":
            if not value:
                raise ProviderNotConfigured(
                    f"{name} is not set: the {self.name!r} provider has nowhere to send notices"
                )
            return str(value).rstrip("/")
        return value

    @property
    def supports_lookup(self) -> bool:
        """On unless ``<prefix>_LOOKUP`` is off: a receiver without the lookup endpoint."""
        return bool(self.setting("LOOKUP"))

    def in_flight_limit(self) -> int | None:
        limit = self.setting("MAX_IN_FLIGHT")
        return int(limit) if limit else None

    def timeout(self) -> httpx.Timeout:
        connect = float(self.setting("CONNECT_TIMEOUT"))
        read = float(self.setting("READ_TIMEOUT"))
        # write: the body is small; pool: never wait for a pooled connection longer
        # than a connect would take.
        return httpx.Timeout(connect=connect, read=read, write=read, pool=connect)

    def _client(self) -> httpx.Client:
        # One client per process and thread (a fork must not share a parent's
        # sockets); rebuilt when the timeouts change (tests, operators).
        timeout = self.timeout()
        key = (os.getpid(), repr(timeout))
        cached = getattr(self._local, "client", None)
        if cached is None or cached[0] != key:
            if cached is not None:
                cached[1].close()
            cached = (key, httpx.Client(timeout=timeout, follow_redirects=False))
            self._local.client = cached
        return cached[1]

    def prepare(self, effect: Effect) -> None:
        # A process's first client loads its TLS context: 0.1-0.3 s on a busy host,
        # which between a rate's start and the call bunched calls at the provider.
        self._client()

    def _auth(self) -> dict[str, str]:
        token = self.setting("TOKEN")
        return {"Authorization": f"Bearer {token}"} if token else {}

    def send(self, effect: Effect) -> str:
        url = self.setting("URL") + "/notices"
        headers = {"Idempotency-Key": effect.idempotency_key, **self._auth()}
        try:
            response = self._client().post(url, json=notice_body(effect), headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ProviderUnreachable(
                f"could not connect to the {self.name!r} provider", code=type(exc).__name__.lower()
            ) from exc
        except (
            httpx.ReadTimeout,
            httpx.WriteTimeout,
            httpx.ReadError,
            httpx.RemoteProtocolError,
        ) as exc:
            # The request went out (or may have): it may have been applied. Same key next time.
            raise ProviderTimeout(
                f"the {self.name!r} provider did not answer in time",
                code=type(exc).__name__.lower(),
            ) from exc
        # 4xx/5xx: the retry table maps the status (and Retry-After) to a class.
        response.raise_for_status()
        if response.status_code not in (200, 201):
            raise ProviderProtocolError(
                f"unexpected status {response.status_code}", code=f"http_{response.status_code}"
            )
        try:
            ref = response.json()["id"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ProviderProtocolError("the answer carried no notice id") from exc
        return str(ref)

    def lookup(self, idempotency_key: str) -> str | None:
        """``GET {url}/notices/{key}``: the notice id when the provider applied the key,
        None on 404 (never seen). Errors never quote the URL: it carries the key."""
        url = self.setting("URL") + LOOKUP_PATH + quote(idempotency_key, safe="")
        try:
            response = self._client().get(url, headers=self._auth())
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ProviderUnreachable(
                f"could not connect to the {self.name!r} provider for a lookup",
                code=type(exc).__name__.lower(),
            ) from None
        except httpx.HTTPError as exc:  # timeouts, a dropped answer: it could not say
            raise ProviderTimeout(
                f"the {self.name!r} provider did not answer a lookup",
                code=type(exc).__name__.lower(),
            ) from None
        status = response.status_code
        if status == 404:
            return None
        if status in (405, 501):
            raise ProviderLookupUnsupported(
                f"the {self.name!r} provider has no lookup (HTTP {status})", code=f"http_{status}"
            )
        if status != 200:
            retry_after = retry.parse_retry_after(response.headers.get("Retry-After"))
            c = retry.classify_status(status, retry_after)
            raise LookupRefused(
                f"the {self.name!r} provider answered a lookup with HTTP {status}",
                error_class=c.error_class,
                code=c.code,
                retry_after=c.retry_after,
            )
        try:
            answer = response.json()
            ref, outcome = answer["id"], answer.get("outcome", "applied")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ProviderProtocolError("the lookup's answer carried no notice id") from None
        if outcome != "applied" or not ref:
            # Only "applied" settles an effect; the other side's word is not quoted.
            raise ProviderProtocolError("the lookup answered an outcome other than applied")
        return str(ref)

    def accepted_since(self, since: float) -> list[Accepted] | None:
        """``GET {url}/notices?since=T``, page after page: what the provider applied from
        ``since`` on; None on 404/405 (a receiver without the listing)."""
        url, after, found = self.setting("URL") + "/notices", None, []
        for _ in range(10_000):  # pages; a provider that never says "no more" is cut off
            query = {"since": f"{since:.3f}", **({"after": after} if after else {})}
            try:
                response = self._client().get(url, params=query, headers=self._auth())
            except httpx.HTTPError as exc:
                raise ProviderUnreachable(
                    f"the {self.name!r} provider did not answer its listing",
                    code=type(exc).__name__.lower(),
                ) from None
            if response.status_code in (404, 405, 501):
                return None
            if response.status_code != 200:
                raise ProviderProtocolError(
                    f"the listing answered HTTP {response.status_code}",
                    code=f"http_{response.status_code}",
                )
            try:
                page = response.json()
                found += [
                    Accepted(
                        str(n["key"]),
                        str(n["id"]),
                        str(n.get("effect_id") or ""),
                        float(n["applied_at"]),
                    )
                    for n in page["notices"]
                ]
                after = page.get("next")
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ProviderProtocolError("the listing's answer is not a page") from None
            if not after:
                return found
        raise ProviderProtocolError("the listing did not end")


class LookupRefused(ProviderError):
    """Raised when the provider answered a lookup with an error status; the retry table
    reads the status's class (a 503 waits, a 401 withholds), as for a send."""

    def __init__(self, detail: str, *, error_class: str, code: str, retry_after: float | None):
        super().__init__(detail, code=code)
        self.error_class = error_class
        self.retry_after = retry_after


@register()
def check_webhook_timing(app_configs=None, **kwargs):
    """A send must end (connect + read + slot wait) before its sending lease expires."""
    provider = WebhookProvider()
    if not conf.get("NOTICE_PROVIDER_URL"):
        return []
    budget = (
        float(provider.setting("CONNECT_TIMEOUT"))
        + float(provider.setting("READ_TIMEOUT"))
        + float(conf.get("JOBS_PROVIDER_SLOT_WAIT_SECONDS"))
    )
    lease = float(conf.get("JOBS_EFFECT_LEASE_SECONDS"))
    if budget >= lease:
        return [
            Error(
                f"NOTICE_PROVIDER_CONNECT_TIMEOUT + NOTICE_PROVIDER_READ_TIMEOUT + "
                f"JOBS_PROVIDER_SLOT_WAIT_SECONDS ({budget:g}) must be below "
                f"JOBS_EFFECT_LEASE_SECONDS ({lease:g})",
                hint="Otherwise a slow send outlives its lease and a second sender starts.",
                id="jobs.E010",
            )
        ]
    return []
