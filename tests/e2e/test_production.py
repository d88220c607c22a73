"""The production command, for real: `scripts/serve.sh` (what `make serve` runs).

DEBUG=0, the site's own settings (``permits.settings``), the test database on
PostgreSQL, migrate + collectstatic + gunicorn with whitenoise on a free loopback
port. Over real HTTP: the login page, a hashed static file, logging in with the CSRF
token, and a reviewer page; the security headers on each (CSP, HSTS behind the proxy
setting with ``X-Forwarded-Proto: https``, ``no-store`` on private pages); then a
real qcluster builds the report, a corrupted copy is refused and the worker restores
it. A second gunicorn without ``BEHIND_PROXY`` shows that the forwarded header is then
not trusted.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import socket
import sys
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from django.contrib.auth.models import Group

from jobs.artifacts import get_storage
from jobs.models import Artifact, Job
from jobs.testing.processes import Proc, Processes
from permits.models import PermitRequest, Tenant
from permits.services import assign_reviewer, report_request
from tests.e2e.processes import ROOT, wait_until

pytestmark = [pytest.mark.drill, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PASSWORD = "reviewer-prod-pass-77"
APPLICANT = "Philippa Quennell-Marsh"
HASHED_CSS = re.compile(r'href="(/static/permits\.[0-9a-f]{12}\.css)"')
INLINE = re.compile(
    r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>|<style\b|\sstyle\s*=", re.I
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(procs: Processes, name: str, argv: list[str], env: dict[str, str]) -> Proc:
    """Like ``Processes.start``, for a command that is not ``manage.py`` (with its own env)."""
    proc = Processes(env, procs.log_dir, command=(), cwd=ROOT).start(name, *argv)
    procs.procs.append(proc)  # stopped with the others by the fixture
    return proc


def production_env(procs: Processes, tmp_path, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in procs.env.items() if k != "BEHIND_PROXY"}
    env.update(
        DJANGO_SETTINGS_MODULE="permits.settings",
        DEBUG="0",
        ALLOWED_HOSTS="127.0.0.1",
        STATIC_ROOT=str(tmp_path / "static"),
        PORT=str(port),
        WEB_CONCURRENCY="2",
        PYTHON=sys.executable,
        **extra,
    )
    return env


def wait_for_http(procs: Processes, port: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        procs.check_alive()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on {port}\n{procs.logs()}") from None
            time.sleep(0.2)


def assert_csp(response: httpx.Response) -> None:
    policy = response.headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy
    assert "style-src 'self'" in policy and "unsafe-inline" not in policy


def assert_hsts(response: httpx.Response) -> None:
    assert response.headers["Strict-Transport-Security"] == (
        "max-age=31536000; includeSubDomains; preload"
    )


def cookies_of(response: httpx.Response) -> dict[str, str]:
    """Set-Cookie values by name, with their attributes (the cookies are Secure: a cookie
    jar would not send them back over this plain-HTTP loopback hop, so we do it by hand)."""
    found = {}
    for header in response.headers.get_list("set-cookie"):
        name, rest = header.split("=", 1)
        found[name] = rest
    return found


@pytest.fixture
def reviewer_with_request():
    office = Tenant.objects.create(key="prod", name="Production Office")
    permit = PermitRequest.objects.create(
        tenant=office,
        reference="PROD-0001",
        site_address="1 Gunicorn Way",
        parcel="G-1",
        work_type=PermitRequest.WorkType.ADDITION,
        description="Rear addition",
        valuation=Decimal("85000"),
        applicant_name=APPLICANT,
        applicant_phone="+1 555 0123",
        applicant_email="p.qm@example.net",
        applicant_id_number="PQ-2231-9981",
    )
    # Hashed as production hashes (the test settings use MD5, which the server refuses).
    hashed = PBKDF2PasswordHasher().encode(PASSWORD, PBKDF2PasswordHasher().salt())
    user = get_user_model().objects.create(username="prod-reviewer", password=hashed)
    user.groups.add(Group.objects.get(name="reviewers"))
    assign_reviewer(permit, user)
    return user, permit


def test_production_server__static_login_and_reviewer_page_with_security_headers(
    procs, tmp_path, reviewer_with_request, settings
):
    _, permit = reviewer_with_request
    # One SECRET_KEY for every process, as in production: django-q2 signs queue messages
    # with it (this test process enqueues too).
    settings.SECRET_KEY = procs.env["SECRET_KEY"] = secrets.token_urlsafe(50)
    port, bare_port = free_port(), free_port()
    start(
        procs,
        "serve",
        ["bash", "scripts/serve.sh"],
        production_env(procs, tmp_path, port, BEHIND_PROXY="1"),
    )
    # The same gunicorn settings without BEHIND_PROXY (no migrate/collectstatic needed).
    start(
        procs,
        "gunicorn-no-proxy",
        [sys.executable, "-m", "gunicorn", "-c", "python:permits.gunicorn_conf", "permits.wsgi"],
        production_env(procs, tmp_path, bare_port),
    )
    wait_for_http(procs, port)
    wait_for_http(procs, bare_port)
    origin = f"https://127.0.0.1:{port}"
    proxy = {"X-Forwarded-Proto": "https"}

    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        # Plain HTTP from outside the proxy is sent to HTTPS.
        plain = http.get("/accounts/login/")
        assert plain.status_code == 301
        assert plain.headers["Location"] == f"{origin}/accounts/login/"

        login_page = http.get("/accounts/login/", headers=proxy)
        assert login_page.status_code == 200
        assert_csp(login_page)
        assert_hsts(login_page)
        assert login_page.headers["X-Frame-Options"] == "DENY"
        assert login_page.headers["X-Content-Type-Options"] == "nosniff"
        assert not INLINE.findall(login_page.text)
        csrf = cookies_of(login_page)["csrftoken"]
        assert "Secure" in csrf
        csrf_token = csrf.split(";", 1)[0]

        # The stylesheet under its hashed name, from whitenoise, cacheable for ever.
        css_url = HASHED_CSS.search(login_page.text).group(1)
        css = http.get(css_url, headers={**proxy, "Accept-Encoding": "gzip"})
        assert css.status_code == 200 and css.headers["Content-Type"].startswith("text/css")
        assert css.headers["Content-Encoding"] == "gzip"
        assert "immutable" in css.headers["Cache-Control"]
        assert ".topbar" in css.text
        assert http.get("/static/no-such-file.css", headers=proxy).status_code == 404

        form_token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login_page.text)
        logged_in = http.post(
            "/accounts/login/",
            data={
                "csrfmiddlewaretoken": form_token.group(1),
                "username": "prod-reviewer",
                "password": PASSWORD,
            },
            headers={
                **proxy,
                "Cookie": f"csrftoken={csrf_token}",
                "Origin": origin,
                "Referer": f"{origin}/accounts/login/",
            },
        )
        assert logged_in.status_code == 302, logged_in.text[:2000]
        assert logged_in.headers["Location"] == "/"
        session = cookies_of(logged_in)["sessionid"]
        assert "Secure" in session and "HttpOnly" in session
        signed_in = {**proxy, "Cookie": f"sessionid={session.split(';', 1)[0]}"}

        for url in ("/", f"/requests/{permit.pk}/", f"/requests/{permit.pk}/status/"):
            page = http.get(url, headers=signed_in)
            assert page.status_code == 200, url
            assert_csp(page)
            assert_hsts(page)
            assert "no-store" in page.headers["Cache-Control"], url
            assert not INLINE.findall(page.text), url
        detail = http.get(f"/requests/{permit.pk}/", headers=signed_in)
        assert permit.reference in detail.text and APPLICANT in detail.text

        # A worker (its own process) builds the report; the download is verified against
        # the sha256; a corrupt file is refused and the worker restores it.
        procs.start("qcluster", "qcluster")
        job, _ = report_request(permit)
        wait_until(
            procs,
            "the report",
            lambda: Job.objects.filter(pk=job.pk, state=Job.State.SUCCEEDED).exists(),
            timeout=90,
        )
        artifact = Artifact.objects.get(job=job)
        download = f"/requests/{permit.pk}/report/"
        first = http.get(download, headers=signed_in)
        assert first.status_code == 200 and "no-store" in first.headers["Cache-Control"]
        assert hashlib.sha256(first.content).hexdigest() == artifact.sha256
        Path(get_storage().path(artifact.storage_name)).write_bytes(b"%PDF-1.4 not the report")
        refused = http.get(download, headers=signed_in)
        assert refused.status_code == 503 and b"not the report" not in refused.content
        assert_csp(refused)
        wait_until(
            procs,
            "the restore",
            lambda: Artifact.objects.filter(pk=artifact.pk, rewrites=1).exists(),
            timeout=90,
        )
        again = http.get(download, headers=signed_in)
        assert again.status_code == 200
        assert hashlib.sha256(again.content).hexdigest() == artifact.sha256

    # Without BEHIND_PROXY the forwarded header proves nothing: still sent to HTTPS.
    with httpx.Client(base_url=f"http://127.0.0.1:{bare_port}", timeout=30) as http:
        spoofed = http.get("/accounts/login/", headers=proxy)
        assert spoofed.status_code == 301
        assert spoofed.headers["Location"] == f"https://127.0.0.1:{bare_port}/accounts/login/"
        assert "Strict-Transport-Security" not in spoofed.headers
