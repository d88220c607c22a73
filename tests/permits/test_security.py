"""Safe by default in production (issue 14), in process and through `manage.py check`.

Start-up refuses a missing or weak SECRET_KEY and a missing ALLOWED_HOSTS with DEBUG
off; `check --deploy` is clean with the documented production variables; logins lock
after N failures per username and address; every page has a CSP without inline code,
and pages for signed-in users are never stored; applicant contacts need their own
permission in the admin; a corrupt report is never sent, and the engine restores it;
malformed ids answer 404 in every admin view. The real gunicorn + whitenoise server is
tests/e2e/test_production.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from axes.models import AccessAttempt
from django.conf import settings
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.management import call_command
from django.test import Client
from django.urls import NoReverseMatch, reverse
from django_q.models import OrmQ

from jobs.artifacts import get_storage, sha256_hex
from jobs.delivery.runner import run_delivery
from jobs.models import Artifact, Job
from jobs.restore import restore_artifact
from permits.models import PRIVATE_FIELDS, ApplicantContactView, PermitRequest
from permits.services import report_request
from tests.permits import factories
from tests.permits.factories import PRIVATE

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "correct-horse-battery-9"


# --- helpers ---------------------------------------------------------------------------


def finished_report(permit: PermitRequest) -> Job:
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "succeeded"
    job.refresh_from_db()
    return job


def signed_in(user, **kwargs) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


@pytest.fixture
def reviewer(make_user):
    user = make_user(username="sec-reviewer", password=PASSWORD)
    user.groups.add(Group.objects.get(name="reviewers"))
    return user


@pytest.fixture
def operator(make_user):
    user = make_user(username="sec-operator", password=PASSWORD, is_staff=True)
    user.groups.add(Group.objects.get(name="operators"))
    return user


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``manage.py`` with the site's own settings and only the given mode variables."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DEBUG", "SECRET_KEY", "ALLOWED_HOSTS", "BEHIND_PROXY")
        and k != "DJANGO_SETTINGS_MODULE"
    }
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


STRONG_KEY = secrets.token_urlsafe(50)


# --- 1. DEBUG off unless set; a missing or weak SECRET_KEY, or no ALLOWED_HOSTS, stops start-up


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ALLOWED_HOSTS": "permits.example.org"}, "SECRET_KEY must be set when DEBUG is off"),
        (
            {"DEBUG": "0", "SECRET_KEY": "x", "ALLOWED_HOSTS": "permits.example.org"},
            "SECRET_KEY is shorter than 50 characters",
        ),
        (
            {
                "DEBUG": "0",
                "SECRET_KEY": "demo-only-insecure-key-do-not-use-in-production",
                "ALLOWED_HOSTS": "permits.example.org",
            },
            "SECRET_KEY is the public demo key",
        ),
        (
            {"DEBUG": "0", "SECRET_KEY": "abab" * 20, "ALLOWED_HOSTS": "permits.example.org"},
            "SECRET_KEY has fewer than 5 different characters",
        ),
        (
            {
                "DEBUG": "0",
                "SECRET_KEY": "django-insecure-" + STRONG_KEY,
                "ALLOWED_HOSTS": "permits.example.org",
            },
            "SECRET_KEY starts with 'django-insecure-'",
        ),
        ({"DEBUG": "0", "SECRET_KEY": STRONG_KEY}, "ALLOWED_HOSTS must be set when DEBUG is off"),
        (
            {"DEBUG": "0", "SECRET_KEY": STRONG_KEY, "ALLOWED_HOSTS": "permits.example.org,*"},
            "ALLOWED_HOSTS must name the site's hosts when DEBUG is off, not '*'",
        ),
    ],
    ids=[
        "debug-unset-no-key",
        "short-key",
        "demo-key",
        "few-characters",
        "insecure-prefix",
        "no-hosts",
        "any-host",
    ],
)
def test_startup__refuses_weak_production_settings_naming_them(env, message):
    proc = manage("check", **env)
    assert proc.returncode != 0, proc.stdout
    assert "ImproperlyConfigured" in proc.stderr and message in proc.stderr, proc.stderr


def test_startup__strong_key_and_hosts_start_with_debug_off():
    proc = manage("check", DEBUG="0", SECRET_KEY=STRONG_KEY, ALLOWED_HOSTS="permits.example.org")
    assert proc.returncode == 0, proc.stderr
    assert "System check identified no issues" in proc.stdout


def test_check_deploy__production_settings_print_no_issue():
    proc = manage(
        "check",
        "--deploy",
        DEBUG="0",
        SECRET_KEY=STRONG_KEY,
        ALLOWED_HOSTS="permits.example.org",
        BEHIND_PROXY="1",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "System check identified no issues (0 silenced).", proc.stdout
    assert proc.stderr == ""


# --- 3. login throttling (django-axes) ------------------------------------------------------


def fail_logins(client: Client, url: str, username: str, times: int) -> list[int]:
    return [
        client.post(url, {"username": username, "password": "wrong-password"}).status_code
        for _ in range(times)
    ]


def test_lockout__site_login_locks_per_username_and_address_then_unlocks(make_user):
    limit = settings.AXES_FAILURE_LIMIT
    assert limit == 5  # the default (LOGIN_FAILURE_LIMIT)
    make_user(username="victim", password=PASSWORD)
    make_user(username="neighbour", password=PASSWORD)
    here = Client(REMOTE_ADDR="203.0.113.7")

    statuses = fail_logins(here, "/accounts/login/", "victim", limit)
    assert statuses == [200] * (limit - 1) + [429]
    locked = here.post("/accounts/login/", {"username": "victim", "password": PASSWORD})
    assert locked.status_code == 429, "the right password must not open a locked login"
    page = locked.content.decode()
    assert "Login locked" in page and f"{limit} failed logins" in page
    assert "frame-ancestors 'none'" in locked["Content-Security-Policy"]
    assert "_auth_user_id" not in here.session

    # Per username and address: the same user elsewhere, another user here, both log in.
    elsewhere = Client(REMOTE_ADDR="198.51.100.20")
    assert elsewhere.post("/accounts/login/", {"username": "victim", "password": PASSWORD})[
        "Location"
    ] == reverse("queue")
    other = Client(REMOTE_ADDR="203.0.113.7")
    assert other.post("/accounts/login/", {"username": "neighbour", "password": PASSWORD})[
        "Location"
    ] == reverse("queue")

    call_command("axes_reset_username", "victim", stdout=open(os.devnull, "w"))  # noqa: SIM115
    unlocked = here.post("/accounts/login/", {"username": "victim", "password": PASSWORD})
    assert unlocked.status_code == 302 and unlocked["Location"] == reverse("queue")


def test_lockout__admin_login_locks_and_an_operator_unlocks_in_the_admin(make_user, operator):
    limit = settings.AXES_FAILURE_LIMIT
    make_user(username="staffer", password=PASSWORD, is_staff=True)
    here = Client(REMOTE_ADDR="203.0.113.9")
    statuses = fail_logins(here, "/admin/login/", "staffer", limit)
    assert statuses[-1] == 429 and set(statuses[:-1]) == {200}
    assert here.post(
        "/admin/login/", {"username": "staffer", "password": PASSWORD}
    ).status_code == (429)

    # The lockout's row in the admin; deleting it (the operators group may) unlocks.
    attempt = AccessAttempt.objects.get(username="staffer")
    desk = signed_in(operator)
    assert desk.get("/admin/axes/accessattempt/").status_code == 200
    done = desk.post(f"/admin/axes/accessattempt/{attempt.pk}/delete/", {"post": "yes"})
    assert done.status_code == 302 and not AccessAttempt.objects.filter(pk=attempt.pk).exists()
    again = here.post("/admin/login/", {"username": "staffer", "password": PASSWORD})
    assert again.status_code == 302 and str(operator.pk) != here.session["_auth_user_id"]
    assert here.session["_auth_user_id"] == str(get_user_model().objects.get(username="staffer").pk)


# --- 4. CSP everywhere, nothing inline; no-store for signed-in pages ---------------------------

INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>", re.I)
INLINE_STYLE = re.compile(r"<style\b|\sstyle\s*=", re.I)


def assert_csp(response) -> None:
    policy = response["Content-Security-Policy"]
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["frame-ancestors"] == "'none'"
    assert directives["script-src"] == "'self'" and directives["style-src"] == "'self'"
    assert directives["default-src"] == "'self'" and directives["object-src"] == "'none'"
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy


def assert_nothing_inline(url: str, response) -> None:
    html = response.content.decode()
    assert not INLINE_SCRIPT.findall(html), f"{url}: inline <script>"
    assert not INLINE_STYLE.findall(html), f"{url}: inline style"


def assert_not_stored(url: str, response) -> None:
    cache = response.get("Cache-Control", "")
    assert "no-store" in cache and "private" in cache, f"{url}: Cache-Control {cache!r}"


def test_reviewer_pages__csp_nothing_inline_and_never_stored(reviewer):
    permit = factories.permit(reviewer=reviewer)
    finished_report(permit)
    client = signed_in(reviewer)
    pages = [
        "/",
        f"/requests/{permit.pk}/",
        f"/requests/{permit.pk}/status/",
        "/notices/",
        "/does-not-exist/",
    ]
    for url in pages:
        response = client.get(url)
        assert response.status_code in (200, 404), url
        assert_csp(response)
        assert_not_stored(url, response)
        assert_nothing_inline(url, response)
    download = client.get(f"/requests/{permit.pk}/report/")
    assert download.status_code == 200
    assert_csp(download)
    assert_not_stored("download", download)
    assert PRIVATE["applicant_name"] in client.get(f"/requests/{permit.pk}/").content.decode()


def test_login_page__csp_and_nothing_inline_for_anonymous_visitors():
    response = Client().get("/accounts/login/")
    assert response.status_code == 200
    assert_csp(response)
    assert_nothing_inline("/accounts/login/", response)


def test_operator_pages__csp_nothing_inline_and_never_stored(operator, reviewer):
    permit = factories.permit(reviewer=reviewer)
    job = finished_report(permit)
    client = signed_in(operator)
    pages = [
        "/admin/",
        "/admin/jobs/job/dashboard/",
        "/admin/jobs/job/",
        f"/admin/jobs/job/{job.pk}/change/",
        "/admin/jobs/effect/",
        "/admin/permits/permitrequest/",
        f"/admin/permits/permitrequest/{permit.pk}/change/",
    ]
    for url in pages:
        response = client.get(url)
        assert response.status_code == 200, url
        assert_csp(response)
        assert_not_stored(url, response)
        assert_nothing_inline(url, response)


# --- 5. applicant contacts: their own permission in the admin, each view recorded ------------


def change_form_data(permit: PermitRequest, **changes) -> dict:
    data = {
        "tenant": permit.tenant_id,
        "reference": permit.reference,
        "status": permit.status,
        "site_address": permit.site_address,
        "parcel": permit.parcel,
        "work_type": permit.work_type,
        "description": permit.description,
        "valuation": str(permit.valuation),
        "decisions-TOTAL_FORMS": "0",
        "decisions-INITIAL_FORMS": "0",
        "decisions-MIN_NUM_FORMS": "0",
        "decisions-MAX_NUM_FORMS": "0",
        "assignment_records-TOTAL_FORMS": "0",
        "assignment_records-INITIAL_FORMS": "0",
        "assignment_records-MIN_NUM_FORMS": "0",
        "assignment_records-MAX_NUM_FORMS": "0",
    }
    data.update(changes)
    return data


def test_contacts__operator_without_the_permission_sees_and_posts_none(operator, reviewer):
    assert not operator.has_perm("permits.view_applicant_contact")
    permit = factories.permit(reviewer=reviewer)
    client = signed_in(operator)
    url = f"/admin/permits/permitrequest/{permit.pk}/change/"

    page = client.get(url)
    assert page.status_code == 200
    html = page.content.decode()
    assert permit.reference in html  # the request itself is there
    for field in PRIVATE_FIELDS:
        assert field not in html and PRIVATE[field] not in html
        assert field not in page.context["adminform"].form.fields
    assert "Applicant" not in html

    posted = client.post(
        url,
        change_form_data(
            permit,
            description="Interior alteration, revised",
            applicant_name="Mallory Forger",
            applicant_email="mallory@example.org",
        ),
    )
    assert posted.status_code == 302, posted.content.decode()[:2000]
    permit.refresh_from_db()
    assert permit.description == "Interior alteration, revised"  # the form was accepted
    assert permit.applicant_name == PRIVATE["applicant_name"]  # ...without the contacts
    assert permit.applicant_email == PRIVATE["applicant_email"]
    assert not ApplicantContactView.objects.exists()


def test_contacts__holder_sees_them_and_each_view_is_recorded(operator, reviewer):
    operator.user_permissions.add(Permission.objects.get(codename="view_applicant_contact"))
    operator = get_user_model().objects.get(pk=operator.pk)  # fresh permission cache
    permit = factories.permit(reviewer=reviewer)
    client = signed_in(operator)
    url = f"/admin/permits/permitrequest/{permit.pk}/change/"
    for _ in range(2):
        html = client.get(url).content.decode()
        assert all(PRIVATE[field] in html for field in PRIVATE_FIELDS)
    views = ApplicantContactView.objects.filter(viewer=operator, request=permit)
    assert views.count() == 2

    # The list page shows no contacts and records nothing.
    listing = client.get("/admin/permits/permitrequest/").content.decode()
    assert PRIVATE["applicant_name"] not in listing and views.count() == 2


def test_contacts__operators_group_never_gets_the_permission_and_reviewers_keep_their_card(
    reviewer,
):
    operators = Group.objects.get(name="operators")
    assert not operators.permissions.filter(codename="view_applicant_contact").exists()
    assert operators.permissions.filter(codename="change_permitrequest").exists()
    permit = factories.permit(reviewer=reviewer)
    card = signed_in(reviewer).get(f"/requests/{permit.pk}/").content.decode()
    assert all(PRIVATE[field] in card for field in PRIVATE_FIELDS)


def test_permit_admin__keeps_no_per_request_state_on_the_shared_instance(operator, reviewer):
    permit = factories.permit(reviewer=reviewer)
    finished_report(permit)
    model_admin = admin.site._registry[PermitRequest]
    before = set(vars(model_admin))
    listing = signed_in(operator).get("/admin/permits/permitrequest/")
    assert listing.status_code == 200
    assert "Succeeded" in listing.content.decode()  # the report column still works
    assert set(vars(model_admin)) == before


# --- 6. downloads verify the bytes; the engine restores a corrupt artifact -------------------


def restore_messages() -> list[tuple]:
    return [(m.func(), m.args()) for m in OrmQ.objects.all() if "restore" in m.func()]


def test_download__corrupt_artifact_is_not_served_and_the_engine_restores_it(reviewer, make_user):
    permit = factories.permit(reviewer=reviewer)
    job = finished_report(permit)
    artifact = Artifact.objects.get(job=job)
    good = get_storage().open(artifact.storage_name).read()
    forged = b"%PDF-1.4 forged bytes that are not the report"
    Path(get_storage().path(artifact.storage_name)).write_bytes(forged)
    url = f"/requests/{permit.pk}/report/"

    # Permission first: someone not assigned learns nothing and triggers nothing.
    stranger = make_user(username="stranger")
    assert signed_in(stranger).get(url).status_code == 404
    assert restore_messages() == []

    response = signed_in(reviewer).get(url)
    assert response.status_code == 503
    assert response["Retry-After"] == "60"
    assert response["Content-Type"].startswith("text/html")
    page = response.content.decode()
    assert "cannot be downloaded right now" in page and "rebuilt automatically" in page
    assert "forged" not in page and "%PDF" not in page
    assert restore_messages() == [("jobs.restore.restore_artifact", (artifact.pk,))]

    # A worker runs the task: the producer runs again and gives the published bytes,
    # which go back under the row's name; the row's hash is the published one.
    published = artifact.sha256
    assert restore_artifact(artifact.pk) == "restored"
    artifact.refresh_from_db()
    assert artifact.rewrites == 1 and artifact.sha256 == published == sha256_hex(good)
    assert artifact.state == "stored" and artifact.restore_requested_at is None
    assert Artifact.objects.filter(job=job).count() == 1
    served = signed_in(reviewer).get(url)
    assert served.status_code == 200
    assert hashlib.sha256(b"".join(served.streaming_content)).hexdigest() == artifact.sha256
    assert restore_artifact(artifact.pk) == "intact"


def test_artifact_folders__explicit_mode_even_under_umask_000(reviewer):
    old = os.umask(0)
    try:
        job = finished_report(factories.permit(reviewer=reviewer))
    finally:
        os.umask(old)
    root = Path(settings.STORAGES["artifacts"]["OPTIONS"]["location"]).resolve()
    folder = Path(get_storage().path(Artifact.objects.get(job=job).storage_name)).parent
    while True:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o750, folder
        if folder == root:
            break
        folder = folder.parent


# --- 7. malformed ids answer 404 in every admin view ------------------------------------------


def admin_object_urls(object_id: str) -> list[tuple[str, str]]:
    """(url, pk type) for the change, history and delete view of every registered model."""
    urls = []
    for model, _ in admin.site._registry.items():
        info = (model._meta.app_label, model._meta.model_name)
        for view in ("change", "history", "delete"):
            try:
                url = reverse(f"admin:{info[0]}_{info[1]}_{view}", args=[object_id])
            except NoReverseMatch:
                continue
            urls.append((url, model._meta.pk.get_internal_type()))
    return urls


def test_admin__abc_ids_answer_404_in_every_admin_view(make_user, reviewer):
    boss = make_user(username="boss", is_staff=True, is_superuser=True)
    client = signed_in(boss)
    permit = factories.permit(reviewer=reviewer)
    group = Group.objects.get(name="reviewers")
    urls = admin_object_urls("abc")
    numeric = [url for url, kind in urls if kind in ("AutoField", "BigAutoField", "IntegerField")]
    assert len(numeric) >= 3 * 10, urls  # ours, auth's, guardian's, axes', django-q2's
    for url, kind in urls:
        status = client.get(url).status_code
        if url in numeric:
            assert status == 404, (url, status)
        else:  # "abc" is a well-formed key there (django-q2's task ids): never a 500
            assert status in (302, 404), (url, kind, status)

    base = "/admin/permits/permitrequest"
    guardian = [
        f"{base}/abc/permissions/",
        f"{base}/abc/permissions/user-manage/{reviewer.pk}/",
        f"{base}/abc/permissions/group-manage/{group.pk}/",
        f"{base}/{permit.pk}/permissions/user-manage/abc/",
        f"{base}/{permit.pk}/permissions/group-manage/abc/",
        "/admin/auth/user/abc/password/",
        f"{base}/abc/change/?_to_field=id",
    ]
    for url in guardian:
        assert client.get(url).status_code == 404, url
    # The same screens with real ids still work.
    assert client.get(f"{base}/{permit.pk}/permissions/").status_code == 200
    assert client.get(f"{base}/{permit.pk}/permissions/user-manage/{reviewer.pk}/").status_code == (
        200
    )
    assert client.get(f"{base}/{permit.pk}/history/").status_code == 200


def test_admin__anonymous_visitors_go_to_the_login_page_whatever_the_id():
    response = Client().get("/admin/permits/permitrequest/abc/change/")
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")
