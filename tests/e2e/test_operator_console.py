"""Issue 32's acceptance in a real headless Chromium, as the ``operator`` (no superuser).

1. The provider is down (its circuit open) and the webhook paused: the verdict's first
   lines name the pause and the open circuit; Resume from the console, after its
   confirmation; the held notices flow again without a shell.
2. One request with bad data fails every try: the verdict names that request, not
   "Failing" for the system; the fix path from the console (the bad value visible on the
   way) to a succeeded job is counted in clicks (at most 8); then "Recovering", and
   "Healthy" once the window (``JOBS_CONSOLE_WINDOW_SECONDS``, 30 s here) has passed the
   last failure (moved back in time, not waited for).

Workers run in-process (``run_delivery``, ``run_queued_effects``), so each step's state is
the one the test means. axe-core runs on every page at 1366 and 390 px: 0 serious and 0
moderate; the totals are printed. Screenshots go to ``var/screenshots/``
(``operator-<width>-<page>.png``).
"""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db.models import F
from django.utils import timezone

from jobs import flow
from jobs.delivery.runner import run_delivery
from jobs.dispatch import dispatch_once
from jobs.models import Attempt, Effect, FlowRule, Job
from jobs.testing.fakeprovider import start_in_thread
from jobs.testing.queue import run_queued_effects
from permits import reports
from permits.models import PermitRequest
from tests.e2e import a11y
from tests.e2e.test_browser import browser, login, shot  # noqa: F401 (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
TOKEN = "console-token-32"
WINDOW = 30
CONSOLE = "/admin/jobs/job/dashboard/"


class Axe:
    """axe-core on every page at both widths: violations kept by impact, screenshots."""

    def __init__(self):
        self.totals = {"critical": 0, "serious": 0, "moderate": 0, "minor": 0}
        self.found: list[str] = []

    def __call__(self, page, width: str, name: str) -> None:
        page.wait_for_load_state()
        shot(page, f"operator-{width}-{name}")
        for v in a11y.violations(page):
            self.totals[v["impact"]] = self.totals.get(v["impact"], 0) + v["count"]
            if v["impact"] in a11y.BLOCKING:
                self.found.append(f"{width}/{name}: {a11y.describe([v])}")

    def assert_clean(self) -> None:
        print("\naxe-core totals on the operator pages:", self.totals)
        assert not self.found, "\n".join(self.found)


def _deliver_until(job: Job, done) -> Job:
    """Deliver ``job`` until ``done(job)``: a delivery may claim another due job first."""
    for _ in range(40):
        Job.objects.filter(pk=job.pk).update(next_attempt_at=job.created_at)
        run_delivery(job.pk)
        job.refresh_from_db()
        if done(job):
            return job
    pytest.fail(f"job {job.pk} stayed {job.state}")


@pytest.fixture
def provider(settings, tmp_path):
    server = start_in_thread(tmp_path / "provider.sqlite3", token=TOKEN)
    settings.NOTICE_PROVIDER_URL = server.url
    settings.NOTICE_PROVIDER_TOKEN = TOKEN
    settings.NOTICE_PROVIDER_CONNECT_TIMEOUT = 1.0
    settings.NOTICE_PROVIDER_READ_TIMEOUT = 2.0
    yield server
    server.stop()


def test_operator__resumes_a_paused_provider_and_fixes_a_dead_request_from_the_console(
    live_server,
    browser,  # noqa: F811 (the fixture imported above)
    provider,
    settings,
):
    from playwright.sync_api import expect

    settings.JOBS_CONSOLE_WINDOW_SECONDS = WINDOW
    settings.JOBS_LEASE_SECONDS = 60  # slow steps inside an attempt on a loaded machine
    call_command("seed_demo", stdout=io.StringIO())
    flow.forget()
    axe = Axe()
    queued = Job.objects.filter(kind=reports.KIND, state=Job.State.QUEUED).order_by("pk")
    notifying, bad = queued[0], queued[1]

    # --- 1. the provider down, the webhook paused: notices wait ---------------------------
    _deliver_until(notifying, lambda j: j.state == Job.State.SUCCEEDED)
    held = Effect.objects.filter(job=notifying, provider="webhook")
    assert held.exists(), "the report asked for a webhook notice"
    flow.pause("provider:webhook", actor="cli:ops")
    FlowRule.objects.filter(scope="provider:webhook").update(
        circuit_state=FlowRule.Circuit.OPEN,
        circuit_failures=5,
        circuit_opened_at=timezone.now(),
        circuit_probe_at=timezone.now() + timedelta(hours=1),
    )
    run_queued_effects()
    assert not held.filter(state=Effect.State.APPLIED).exists(), "held by the pause"

    context = browser.new_context(viewport=a11y.VIEWPORTS["desktop"])
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.goto(live_server.url + "/admin/login/")
    axe(page, "desktop", "login")
    login(page, live_server.url, "/admin/login/", "operator", "operator-demo")
    page.goto(live_server.url + CONSOLE)
    expect(page.locator("#health-status")).to_have_text("Failing")
    reasons = page.locator(".console-health__reasons > li")
    expect(reasons.nth(0)).to_have_attribute("data-reason", "paused")
    expect(reasons.nth(0)).to_contain_text("provider:webhook is paused")
    expect(reasons.nth(0)).to_contain_text("1 effect waiting")  # what waits behind it
    expect(reasons.nth(1)).to_have_attribute("data-reason", "circuit")
    expect(reasons.nth(1)).to_contain_text("Provider webhook: circuit open")
    expect(reasons.nth(1).locator("a.console-fix")).to_have_text("Open webhook's effects")
    axe(page, "desktop", "console-paused")
    reasons.nth(0).get_by_role("button", name="Resume provider:webhook").click()
    expect(page.locator("#toggle-preview")).to_contain_text("Resume provider:webhook")
    axe(page, "desktop", "resume-confirm")
    page.click("#toggle-confirm")
    expect(page.locator(".messagelist")).to_contain_text("Resumed provider:webhook")
    assert not FlowRule.objects.get(scope="provider:webhook").paused

    # The provider answers again: the next probe closes the circuit and the notices flow.
    FlowRule.objects.filter(scope="provider:webhook").update(circuit_probe_at=timezone.now())
    Effect.objects.filter(provider="webhook").update(next_attempt_at=timezone.now())
    flow.forget()
    for _ in range(5):
        dispatch_once()
        run_queued_effects()
        if not held.exclude(state=Effect.State.APPLIED).exists():
            break
    assert not held.exclude(state=Effect.State.APPLIED).exists(), list(
        held.values_list("state", "reason")
    )
    page.goto(live_server.url + CONSOLE)
    expect(page.locator('[data-reason="paused"]')).to_have_count(0)
    expect(page.locator('[data-reason="circuit"]')).to_have_count(0)

    # --- 2. one request with bad data fails every try --------------------------------------
    permit = PermitRequest.objects.get(pk=bad.subject_id)
    PermitRequest.objects.filter(pk=permit.pk).update(work_type="pool")
    bad = _deliver_until(bad, lambda j: j.state == Job.State.DEAD)
    page.goto(live_server.url + CONSOLE)
    expect(page.locator("#health-status")).not_to_have_text("Failing")
    named = page.locator('[data-reason="one-subject"]')
    expect(named).to_contain_text(f"1 permit request fails every try: {permit.reference}")
    axe(page, "desktop", "console-one-subject")

    # The fix path, in clicks from the console to a succeeded job.
    clicks = 0

    def click(target) -> None:
        nonlocal clicks
        clicks += 1
        (page.locator(target) if isinstance(target, str) else target).click()

    click(named.locator("a.console-fix"))
    expect(page.locator("#fix-subject")).to_be_visible()
    axe(page, "desktop", "job-dead")
    click("#fix-subject")
    work_type = page.locator("select[name=work_type]")
    expect(work_type.locator("option:checked")).to_have_text("pool (not a valid choice)")
    axe(page, "desktop", "permit-bad-value")
    clicks += 1  # choosing the valid value is one action
    work_type.select_option("alteration")
    click("input[name=_save]")
    expect(page.locator(".messagelist")).to_contain_text(f"Back to job {bad.pk}")
    click("#operate-requeue")
    axe(page, "desktop", "requeue-confirm")
    click("#operate-confirm")
    bad = _deliver_until(bad, lambda j: j.state == Job.State.SUCCEEDED)
    print(f"\nfix path: {clicks} clicks from the console to a succeeded job")
    assert clicks <= 8

    page.goto(live_server.url + CONSOLE)
    expect(page.locator("#health-status")).to_have_text("Recovering")
    expect(page.locator('[data-reason="recovering"]')).to_contain_text("No try has failed since")
    axe(page, "desktop", "console-recovering")
    # The window passes the last failure (moved back in time instead of waited for).
    shift = timedelta(seconds=WINDOW + 1)
    Attempt.objects.filter(job=bad).exclude(outcome=Attempt.Outcome.SUCCEEDED).update(
        started_at=F("started_at") - shift, finished_at=F("finished_at") - shift
    )
    page.goto(live_server.url + CONSOLE)
    expect(page.locator("#health-status")).to_have_text("Healthy")
    axe(page, "desktop", "console-healthy")
    context.close()

    # --- the same pages on a phone ----------------------------------------------------------
    flow.pause("provider:webhook", actor="cli:ops")
    phone = browser.new_context(viewport=a11y.VIEWPORTS["phone"]).new_page()
    phone.set_default_timeout(20_000)
    phone.goto(live_server.url + "/admin/login/")
    axe(phone, "phone", "login")
    login(phone, live_server.url, "/admin/login/", "operator", "operator-demo")
    phone.goto(live_server.url + CONSOLE)
    axe(phone, "phone", "console-paused")
    phone.get_by_role("button", name="Resume provider:webhook").first.click()
    axe(phone, "phone", "resume-confirm")
    phone.goto(live_server.url + f"/admin/jobs/job/{bad.pk}/change/")
    axe(phone, "phone", "job-succeeded")
    phone.goto(live_server.url + f"/admin/permits/permitrequest/{permit.pk}/change/?_job={bad.pk}")
    axe(phone, "phone", "permit")
    phone.goto(live_server.url + f"/admin/jobs/job/{bad.pk}/operate/requeue/")
    axe(phone, "phone", "requeue-confirm")
    axe.assert_clean()
