"""Reviewer notices for every turn (issue 33), with real workers and a real browser.

- A report that dies (every try raises an unexpected error): the assigned reviewer's
  inbox has "Report could not be built" once, also when the worker is SIGKILLed in the
  middle of releasing that notice (its insert waits on a lock this test holds, then the
  whole cluster is killed; a second cluster finishes it after the lease runs out).
- A new assignment through the assign page: one "New request assigned to you".
- A revocation (confirmed): the inbox holds no link to a 404.

``manage.py qcluster`` and ``manage.py jobs_dispatcher`` run as subprocesses on the test
database (``tests/e2e/processes.py``); Playwright drives ``/usr/bin/chromium``.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group

from jobs.models import Effect, Job, Notice
from permits import notices, selectors
from permits.models import PermitRequest, Tenant
from permits.services import assign_reviewer
from permits.signals import OFFICE_ADMINS
from tests.e2e import a11y
from tests.e2e.processes import job_table, wait_until
from tests.e2e.test_browser import browser, login, shot  # noqa: F401 (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
PASSWORD = "notice-pass-9"
State = Job.State


def _expect():
    from playwright.sync_api import expect

    return expect


def _people():
    office = Tenant.objects.create(key="noticeville", name="Noticeville Permit Office")
    User = get_user_model()
    reviewer = User.objects.create_user("notice-reviewer", password=PASSWORD)
    reviewer.groups.add(Group.objects.get(name="reviewers"))
    desk = User.objects.create_user("notice-desk", password=PASSWORD, is_staff=True)
    desk.groups.add(Group.objects.get(name=OFFICE_ADMINS))
    office.members.add(reviewer, desk)
    return office, reviewer, desk


def _permit(office, reference: str, **fields) -> PermitRequest:
    values = {
        "tenant": office,
        "reference": reference,
        "site_address": "5 Notice Road",
        "parcel": "NV-5",
        "work_type": PermitRequest.WorkType.ALTERATION,
        "description": "Alteration",
        "valuation": 20000,
        "applicant_name": "Nina Notice",
        "applicant_phone": "+1 555 0177",
        "applicant_email": "nina@example.org",
        "applicant_id_number": "NV-77",
        **fields,
    }
    return PermitRequest.objects.create(**values)


def _lock_notices():
    """A second session that holds an EXCLUSIVE lock on the notice table: an in-app
    notice's insert (the release of the notice) waits on it."""
    db = settings.DATABASES["default"]
    conn = psycopg.connect(
        host=db.get("HOST") or "127.0.0.1",
        port=db.get("PORT") or 5432,
        user=db.get("USER") or None,
        dbname=db["NAME"],
        autocommit=False,
    )
    conn.execute("LOCK TABLE jobs_notice IN EXCLUSIVE MODE")
    return conn


def _waiting_on_the_lock(conn) -> bool:
    """Whether another session waits for a lock on the notice table (pg_locks: the
    statement's text may be cut short in pg_stat_activity)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        "WHERE c.relname = 'jobs_notice' AND NOT l.granted"
    ).fetchone()
    return row[0] > 0


def test_notices__a_report_that_dies_is_told_once_also_when_the_worker_is_killed_mid_release(
    live_server,
    procs,
    browser,  # noqa: F811 (the fixture imported above)
):
    expect = _expect()
    office, reviewer, _ = _people()
    permit = _permit(office, "NV-2026-0001", status=PermitRequest.Status.IN_REVIEW)
    assign_reviewer(permit, reviewer)  # by the system: asks for the report, no notice
    report = selectors.report_job(permit)
    # Its try raises an unexpected error (a work type the fee table does not know), and
    # it has a budget of one try: the report is dead after it (one stop, one notice job).
    PermitRequest.objects.filter(pk=permit.pk).update(work_type="bogus")
    Job.objects.filter(pk=report.pk).update(max_attempts=1)

    lock = _lock_notices()
    env = {**procs.env, "JOBS_LEASE_SECONDS": "4"}  # lock timeout 2 s: time to kill
    first = procs.start("qcluster-1", "qcluster", env=env)
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.3", env=env)
    try:
        wait_until(
            procs,
            "the stop notice's release to wait on the notice table",
            lambda: _waiting_on_the_lock(lock),
            timeout=60,
            interval=0.02,
        )
        procs.kill_group(first)  # mid-release: its transaction dies with it
    finally:
        lock.rollback()
        lock.close()
    report.refresh_from_db()
    assert report.state == State.DEAD, job_table()
    [stop] = Job.objects.filter(kind=notices.STOPPED)
    assert stop.state == State.RUNNING, job_table()  # its owner is dead, lease running
    assert not Notice.objects.filter(recipient=reviewer).exists()
    print(f"killed {first.name} while job {stop.pk} released its notice")

    procs.start("qcluster-2", "qcluster", env=env)
    wait_until(
        procs,
        f"stop notice job {stop.pk} to succeed after the kill",
        lambda: Job.objects.filter(pk=stop.pk, state=State.SUCCEEDED).exists(),
        timeout=60,
    )
    time.sleep(1.5)  # a late duplicate delivery, if any, has had its chance
    stop.refresh_from_db()
    assert stop.attempts >= 2, job_table()
    mine = list(Notice.objects.filter(recipient=reviewer).values_list("title", flat=True))
    assert mine == [
        "Report could not be built: NV-2026-0001 revision 1. "
        "The office has been told; nothing to do for you."
    ], mine
    assert Effect.objects.filter(job=stop, recipient=str(reviewer.pk)).count() == 1
    assert Job.objects.filter(kind=notices.STOPPED).count() == 1

    page = browser.new_context(viewport=a11y.VIEWPORTS["desktop"]).new_page()
    page.set_default_timeout(20_000)
    login(page, live_server.url, "/accounts/login/", "notice-reviewer", PASSWORD)
    page.goto(f"{live_server.url}/notices/")
    expect(page.locator(".inbox__item", has_text="could not be built")).to_have_count(1)
    shot(page, "notices-desktop-could-not-be-built")
    assert not a11y.blocking(a11y.violations(page))
    with page.expect_navigation():
        page.locator(".inbox__open button", has_text="could not be built").click()
    expect(page.locator("h1")).to_contain_text("NV-2026-0001")
    # A stop a rebuild cannot change: no Rebuild, the office has been told.
    expect(page.locator("#rebuild-report")).to_have_count(0)
    expect(page.locator("#no-rebuild")).to_contain_text("The office has been told")
    shot(page, "notices-desktop-stopped-request")
    assert not a11y.blocking(a11y.violations(page)), a11y.describe(a11y.violations(page))


def test_notices__assignment_tells_once_and_revocation_leaves_no_link_to_a_404(
    live_server,
    procs,
    browser,  # noqa: F811
):
    expect = _expect()
    office, reviewer, _desk = _people()
    permit = _permit(office, "NV-2026-0002")
    procs.start("qcluster", "qcluster")
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.3")
    base = live_server.url

    admin_page = browser.new_context(viewport=a11y.VIEWPORTS["phone"]).new_page()
    admin_page.set_default_timeout(20_000)
    login(admin_page, base, "/accounts/login/", "notice-desk", PASSWORD)
    admin_page.goto(f"{base}/admin/permits/permitrequest/{permit.pk}/change/")
    admin_page.click("#assign-reviewers")
    admin_page.select_option("#id_reviewer", label="notice-reviewer")
    admin_page.locator("#assign-form input[type=submit]").click()
    expect(admin_page.locator(".messagelist")).to_contain_text("now reviews NV-2026-0002")

    wait_until(
        procs,
        "the assignment's notice",
        lambda: Notice.objects.filter(recipient=reviewer).exists(),
        timeout=45,
    )
    time.sleep(1.0)
    assert list(Notice.objects.filter(recipient=reviewer).values_list("title", flat=True)) == [
        "New request assigned to you: NV-2026-0002"
    ]
    inbox = browser.new_context(viewport=a11y.VIEWPORTS["phone"]).new_page()
    inbox.set_default_timeout(20_000)
    login(inbox, base, "/accounts/login/", "notice-reviewer", PASSWORD)
    inbox.goto(f"{base}/notices/")
    expect(inbox.locator(".inbox__item")).to_have_count(1)
    expect(inbox.locator(".inbox__item")).to_contain_text("New request assigned to you")
    shot(inbox, "notices-phone-assigned")
    assert a11y.scroll_width(inbox) <= 390
    with inbox.expect_navigation():
        inbox.locator(".inbox__open button").first.click()
    expect(inbox.locator("h1")).to_contain_text("NV-2026-0002")

    admin_page.goto(f"{base}/admin/permits/permitrequest/{permit.pk}/reviewers/")
    admin_page.click(f"#revoke-{reviewer.pk}")
    expect(admin_page.locator("#revoke-losses")).to_be_visible()
    admin_page.click("#confirm-revoke")
    expect(admin_page.locator(".messagelist")).to_contain_text("no longer reviews NV-2026-0002")

    inbox.goto(f"{base}/notices/")
    expect(inbox.locator("[data-notice-gone]")).to_have_text("No longer assigned: NV-2026-0002")
    expect(inbox.locator(".inbox__open button")).to_have_count(0)  # nothing to follow
    hrefs = inbox.locator("main a").evaluate_all("els => els.map(e => e.href)")
    for href in hrefs:
        assert inbox.request.get(href).status != 404, href
    shot(inbox, "notices-phone-after-revocation")
    assert not a11y.blocking(a11y.violations(inbox))
