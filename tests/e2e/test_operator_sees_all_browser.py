"""Issue 44's acceptance in a real headless Chromium against real ``jobs_worker`` processes
(one for the default queue, one for the ``heavy`` queue, as ``make demo`` starts them).

The ``operator`` (no superuser) walks: a paused provider named on the console and resumed
from it; a dead report whose cause is a data error, read in words (no exception class
needed) and fixed from the console in at most 8 clicks; the seeded decision's chain (the
decision job, then the applicant's letter on the heavy queue, with its steps) and the
morning digest's schedule and tick on the console; a multi-step report whose steps
(gather, render, store) are visible and whose progress moves on its open page without a
reload; a job its own parameters stop, which is offered only "Fail it" and is failed with
the operator's reason. axe-core runs on every page visited (0 critical, serious or
moderate); screenshots at 1280 and 390 px go to ``var/screenshots/``
(``issue44-<width>-<page>.png``).
"""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

import jobs
from jobs import flow
from jobs import services as job_services
from jobs.models import Job, JobEvent, JobStep
from permits import digest, letters, reports, services
from permits.management.commands.seed_demo import DECIDED_PERMIT_ID
from permits.models import PermitRequest, ReviewDecision
from tests.e2e import a11y
from tests.e2e.processes import subprocess_env, wait_until
from tests.e2e.test_browser import SCREENSHOTS, browser, login  # noqa: F401 (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
CONSOLE = "/admin/jobs/job/dashboard/"
WIDTHS = {"1280": {"width": 1280, "height": 900}, "390": {"width": 390, "height": 844}}
# The report's pace between stages: watchable (progress is written at most once a second,
# counted from the claim), within Q_CLUSTER timeout.
STAGE_SECONDS = "1.9"
DIGEST_CRON = "0 7 * * 1-5"  # the demo's (the test settings give the digest no schedule)


@pytest.fixture
def digest_scheduled(settings):
    """The morning digest periodic, as in the demo, here and in the workers' environment."""
    settings.PERMITS_DIGEST_CRON = DIGEST_CRON
    digest.register()
    yield
    settings.PERMITS_DIGEST_CRON = ""
    digest.register()


class Seen:
    """axe-core and a screenshot for every page visited, at the width of the context."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.pages = 0

    def __call__(self, page, width: str, name: str) -> None:
        page.wait_for_load_state()
        page.screenshot(path=str(SCREENSHOTS / f"issue44-{width}-{name}.png"), full_page=True)
        self.pages += 1
        blocking = a11y.blocking(a11y.violations(page))
        if blocking:
            self.found.append(f"{width}/{name}: {a11y.describe(blocking)}")

    def assert_clean(self) -> None:
        print(f"\naxe-core over {self.pages} page states: {len(self.found)} with findings")
        assert not self.found, "\n".join(self.found)


def test_operator__sees_causes_steps_and_live_progress_with_a_real_worker(
    live_server,
    procs,
    digest_scheduled,
    browser,  # noqa: F811 (the fixture imported above)
):
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import expect

    call_command("seed_demo", stdout=io.StringIO())
    bad = PermitRequest.objects.get(pk=3)
    PermitRequest.objects.filter(pk=bad.pk).update(work_type="pool")  # not a choice
    flow.pause("provider:webhook", actor="cli:ops")
    # The webhook's scope is paused (as an operator on call would after its outages);
    # the notices here go to the reviewers' inboxes.
    env = {
        **subprocess_env(),
        "PERMITS_REPORT_STAGE_SECONDS": "0",
        "PERMITS_DIGEST_CRON": DIGEST_CRON,
    }
    procs.start("worker", "jobs_worker", env=env)
    procs.start("worker-heavy", "jobs_worker", "--queue", letters.QUEUE, env=env)
    seen = Seen()
    base = live_server.url

    bad_job = wait_until(
        procs,
        "the report of the request with bad data to stop",
        lambda: Job.objects.filter(
            kind=reports.KIND, subject_id=str(bad.pk), state=Job.State.DEAD
        ).first(),
        timeout=120,
        interval=0.5,
    )
    assert bad_job.last_error_code == "work_type_invalid"

    context = browser.new_context(viewport=WIDTHS["1280"])
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(base + "/admin/login/")
    seen(page, "1280", "login")
    login(page, base, "/admin/login/", "operator", "operator-demo")

    # --- 1. the paused provider: named first, resumed from the console ------------------
    page.goto(base + CONSOLE)
    paused = page.locator('[data-reason="paused"]')
    expect(paused).to_contain_text("provider:webhook is paused")
    seen(page, "1280", "console-paused")
    paused.locator("button").click()
    seen(page, "1280", "resume-confirm")
    page.locator("#toggle-confirm").click()
    expect(page.locator(".messagelist")).to_contain_text("Resumed provider:webhook")
    expect(page.locator('[data-reason="paused"]')).to_have_count(0)

    # --- 2. the dead report: its cause in words, fixed from the console -----------------
    clicks = 0

    def click(target) -> None:
        nonlocal clicks
        clicks += 1
        (page.locator(target) if isinstance(target, str) else target).click()

    page.goto(base + CONSOLE)
    row = page.locator(
        "#failures tr", has=page.locator(f'a[href$="/jobs/job/{bad_job.pk}/change/"]')
    )
    expect(row).to_contain_text("work type is not one of the valid choices")
    seen(page, "1280", "console-failure")
    click(row.locator(f'a[href$="/jobs/job/{bad_job.pk}/change/"]'))
    expect(page.locator(".field-cause")).to_contain_text(
        "The request's work type is not one of the valid choices"
    )
    expect(page.locator(".field-cause")).to_contain_text("Correct the work type on the request")
    seen(page, "1280", "job-dead-cause")
    click("#fix-subject")
    work_type = page.locator("select[name=work_type]")
    expect(work_type.locator("option:checked")).to_have_text("pool (not a valid choice)")
    seen(page, "1280", "permit-bad-value")
    clicks += 1  # choosing the valid value is one action
    work_type.select_option("alteration")
    click("input[name=_save]")
    expect(page.locator(".messagelist")).to_contain_text(f"Back to job {bad_job.pk}")
    click("#operate-requeue")
    seen(page, "1280", "requeue-confirm")
    click("#operate-confirm")
    wait_until(
        procs,
        "the requeued report to succeed",
        lambda: Job.objects.filter(pk=bad_job.pk, state=Job.State.SUCCEEDED).exists(),
        timeout=60,
        interval=0.3,
    )
    # The page follows the outcome and reloads itself once settled (jobs/follow.js).
    expect(page.locator("div.form-row.field-state_word")).to_contain_text("Ready")
    seen(page, "1280", "job-fixed")
    print(f"\nfix path: {clicks} clicks from the console to a succeeded job")
    assert clicks <= 8

    # --- 3. the decision's chain, the heavy queue and the periodic digest ----------------
    decision = ReviewDecision.objects.get(request_id=DECIDED_PERMIT_ID)
    head = Job.objects.get(kind=letters.DECISION, subject_id=str(decision.pk))
    letter = wait_until(
        procs,
        "the decision letter to be stored by the heavy queue's worker",
        lambda: Job.objects.filter(parent=head, state=Job.State.SUCCEEDED).first(),
        timeout=120,
        interval=0.5,
    )
    tick = wait_until(
        procs,
        "the seeded digest tick to run",
        lambda: Job.objects.filter(kind=digest.KIND, state=Job.State.SUCCEEDED).first(),
        timeout=60,
        interval=0.5,
    )
    page.goto(base + CONSOLE)
    # (The console's queue table lists queues with waiting work: the heavy queue's worker
    # left it none. The jobs list below shows its job by the queue filter.)
    expect(page.locator(f'#schedules tr[data-schedule="{digest.KIND}"]')).to_contain_text(
        DIGEST_CRON
    )
    seen(page, "1280", "console-schedules")
    page.goto(base + f"/admin/jobs/job/{head.pk}/change/")
    expect(page.locator(".field-progress")).to_contain_text("1 of 1 (100%): report found")
    expect(page.locator("#steps-group")).to_contain_text("check")
    seen(page, "1280", "job-chain-head")
    page.locator(f'a[href$="/jobs/job/{letter.pk}/change/"]').first.click()
    expect(page.locator(".fieldBox.field-queue")).to_contain_text(letters.QUEUE)
    expect(page.locator(".field-chain")).to_contain_text("requested by")
    for name in ("render", "store"):
        expect(page.locator("#steps-group")).to_contain_text(name)
    expect(page.locator(".field-progress")).to_contain_text("2 of 2 (100%): stored")
    seen(page, "1280", "job-letter")
    page.goto(base + f"/admin/jobs/job/{tick.pk}/change/")
    # The digest names no states of its own: the engine's neutral word (the report's
    # "Ready" is its kind's label, permits.reports.LABELS).
    expect(page.locator("div.form-row.field-state_word")).to_contain_text("Done")
    seen(page, "1280", "job-digest")
    page.goto(base + f"/admin/jobs/job/?queue={letters.QUEUE}")
    expect(page.locator(f'a[href*="/jobs/job/{letter.pk}/change/"]')).to_have_count(1)
    seen(page, "1280", "jobs-list-heavy")

    # --- 4. a multi-step report: progress moves on its open page, then its steps --------
    procs.stop_all()
    procs.start(
        "worker-paced", "jobs_worker", env={**env, "PERMITS_REPORT_STAGE_SECONDS": STAGE_SECONDS}
    )
    flow.pause(f"kind:{reports.KIND}", actor="cli:ops")  # held until the page is open
    reviewer = get_user_model().objects.get(username="reviewer47")
    permit = PermitRequest.objects.get(pk=1)
    wait_until(
        procs,
        "request 1's report to be settled",
        lambda: Job.objects.filter(
            kind=reports.KIND, subject_id="1", state=Job.State.SUCCEEDED
        ).exists(),
        timeout=60,
        interval=0.5,
    )
    permit.refresh_from_db()
    rebuilt, created = services.rebuild_report(
        permit, reviewer, seen_revision=permit.output_revision
    )
    assert created and rebuilt.priority == services.REBUILD_PRIORITY
    page.goto(base + f"/admin/jobs/job/{rebuilt.pk}/change/")
    expect(page.locator("#jobs-live")).to_be_visible()
    expect(page.locator(".fieldBox.field-queue")).to_contain_text("default")
    expect(page.locator(".fieldBox.field-priority")).to_contain_text(str(services.REBUILD_PRIORITY))
    seen(page, "1280", "job-queued-live")
    page.evaluate("window.__samePage = true")
    flow.resume(f"kind:{reports.KIND}", actor="cli:ops")
    progress = page.locator(".field-progress .readonly")
    values: list[str] = []
    for _ in range(80):
        page.wait_for_timeout(250)
        try:
            if not page.evaluate("window.__samePage === true"):
                break  # reloaded: the job finished
            text = progress.text_content(timeout=1000) or ""
        except PlaywrightError:  # the reload began while we looked
            break
        if "of 3" in text and text not in values:
            values.append(text)
    page.wait_for_load_state()
    print(f"progress seen on the open page without a reload: {values}")
    rebuilt.refresh_from_db()
    assert rebuilt.state == Job.State.SUCCEEDED, (
        rebuilt.state,
        rebuilt.last_error_class,
        rebuilt.last_error_code,
        procs.logs(tail=60),
    )
    assert len(values) >= 2, values
    expect(page.locator("div.form-row.field-state_word")).to_contain_text("Ready")
    steps = list(JobStep.objects.filter(job=rebuilt).values_list("name", flat=True))
    assert steps == ["gather", "render", "store"]
    for name in steps:
        expect(page.locator("#steps-group")).to_contain_text(name)
    expect(page.locator(".field-progress")).to_contain_text("3 of 3 (100%): stored")
    seen(page, "1280", "job-steps")

    # --- 5. a job its own parameters stop: only "Fail it", with the reason --------------
    malformed = jobs.request(reports.KIND, (reports.SUBJECT_TYPE, "not-a-permit")).job
    wait_until(
        procs,
        "the malformed report to fail at once",
        lambda: Job.objects.filter(pk=malformed.pk, state=Job.State.FAILED).exists(),
        timeout=60,
        interval=0.3,
    )
    # The reports are held while a script (not the console, which would refuse) requeues
    # it: it waits to run again, and would fail the same way.
    flow.pause(f"kind:{reports.KIND}", actor="cli:ops")
    malformed.refresh_from_db()
    assert job_services.requeue_job(malformed, operator="script")
    page.goto(base + f"/admin/jobs/job/{malformed.pk}/change/")
    expect(page.locator(".field-cause")).to_contain_text("own parameters are malformed")
    expect(page.locator("#operate-fail")).to_be_visible()
    for other in ("cancel", "retry_now", "requeue"):
        expect(page.locator(f"#operate-{other}")).to_have_count(0)
    expect(page.locator("#fix-subject")).to_have_count(0)
    seen(page, "1280", "job-malformed")
    page.locator("#operate-fail").click()
    seen(page, "1280", "fail-confirm")
    page.set_viewport_size(WIDTHS["390"])  # the reason's form on a phone as well
    seen(page, "390", "fail-confirm")
    page.set_viewport_size(WIDTHS["1280"])
    reason = "Asked for a request id that is no number: nothing can build it."
    page.fill("#operate-reason", reason)
    page.locator("#operate-confirm").click()
    expect(page.locator(".messagelist")).to_contain_text(f"Fail it: done for job {malformed.pk}")
    expect(page.locator("div.form-row.field-state_word")).to_contain_text("Could not be built")
    expect(page.locator("#content-main")).to_contain_text(reason)
    seen(page, "1280", "job-failed-with-reason")
    flow.resume(f"kind:{reports.KIND}", actor="cli:ops")
    event = JobEvent.objects.get(job=malformed, action="fail")
    assert (event.from_state, event.to_state, event.note) == ("queued", "failed", reason)

    # --- the same pages on a phone --------------------------------------------------------
    phone = browser.new_context(viewport=WIDTHS["390"]).new_page()
    phone.set_default_timeout(30_000)
    login(phone, base, "/admin/login/", "operator", "operator-demo")
    for name, path in (
        ("console", CONSOLE),
        ("job-fixed", f"/admin/jobs/job/{bad_job.pk}/change/"),
        ("job-steps", f"/admin/jobs/job/{rebuilt.pk}/change/"),
        ("jobs-list", "/admin/jobs/job/?queue=default"),
        ("job-letter", f"/admin/jobs/job/{letter.pk}/change/"),
        ("job-failed-with-reason", f"/admin/jobs/job/{malformed.pk}/change/"),
    ):
        phone.goto(base + path)
        seen(phone, "390", name)
    page.goto(base + "/admin/jobs/job/")
    expect(page.locator("th.column-queue_column")).to_be_visible()
    seen(page, "1280", "jobs-list")
    seen.assert_clean()
