"""The console's first line (issue 21): healthy, degraded or failing, with the reasons;
dead and failed jobs listed with their error; reached from the admin index."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db.models import F
from django.db.models.functions import Now

from jobs.delivery.runner import run_delivery
from jobs.models import Attempt, Job
from jobs.ops import console
from tests.permits.test_admin import (  # noqa: F401 (fixture)
    dead_job,
    demo,
    failing_job,
    login,
)


def seeded_effect_id() -> str:
    """The seeded job 84's notice to reviewer47: its id derives from the job's uid."""
    return f"{Job.objects.get(pk=84).uid}:29:completion-notice:47"


pytestmark = pytest.mark.django_db


def _reasons(page: str) -> dict[str, str]:
    return dict(re.findall(r'data-reason="([\w-]+)" data-level="(\w+)"', page))


def test_health__healthy_when_nothing_failed_and_nothing_waits():
    snap = console.snapshot()
    health = console.health(snap)
    assert health.status == "healthy" and not health.problems


def test_health__failing_with_the_failure_rate_and_the_dead_job_listed(demo):  # noqa: F811
    job, _other = dead_job(1), dead_job(2)  # two subjects: the system, not one subject
    client = login(demo, "operator")
    page = client.get("/admin/jobs/job/dashboard/").content.decode()
    assert re.search(r'id="health-status">Failing<', page)
    reasons = _reasons(page)
    assert reasons["failure-rate"] == "bad"  # 6 of 6 tries failed
    assert "100% of tries failed in the last 5 min (6 of 6)" in page
    assert "one-subject" not in reasons
    assert reasons["stopped"] == "warn" and "Problem" in page  # a text label, not colour alone
    failures = page[page.index('id="failures"') :]
    assert f'/admin/jobs/job/{job.pk}/change/">{job.pk}<' in failures
    assert "test.short" in failures and "temporary" in failures


def test_health__degraded_for_effects_needing_review(demo):  # noqa: F811
    from jobs.models import Effect

    run_delivery(84)
    Effect.objects.filter(job_id=84).update(state=Effect.State.NEEDS_REVIEW)
    from jobs.models import Job

    Job.objects.exclude(pk=84).delete()  # nothing waiting: only the review is a problem
    health = console.health(console.snapshot())
    assert health.status == "degraded"
    assert [r.key for r in health.problems] == ["needs-review"]


def test_admin_index__links_the_console_for_operators(demo):  # noqa: F811
    page = login(demo, "operator").get("/admin/").content.decode()
    assert 'href="/admin/jobs/job/dashboard/"' in page and "Operations console" in page
    assert "Permit review · operations" in page


def test_chart__completed_and_failed_per_minute_filtered_by_kind(demo):  # noqa: F811
    dead_job()
    run_delivery(84)
    client = login(demo, "operator")
    page = client.get("/admin/jobs/job/dashboard/").content.decode()
    assert re.search(r"1 jobs completed and 3 tries failed in the last 60 minutes", page)
    only = client.get("/admin/jobs/job/dashboard/?kind=test.short").content.decode()
    assert "0 jobs completed and 3 tries failed in the last 60 minutes for test.short" in only
    assert 'kind=test.short" data-interval-ms' in only  # the refresh keeps the filter


def test_search__jobs_by_error_and_effects_by_recipient_username(demo):  # noqa: F811
    job = dead_job()
    run_delivery(84)
    client = login(demo, "operator")
    found = client.get("/admin/jobs/job/?q=test_unavailable").content.decode()
    assert f"/admin/jobs/job/{job.pk}/change/" in found
    assert "/admin/jobs/job/84/change/" not in found
    effects = client.get("/admin/jobs/effect/?q=reviewer47").content.decode()
    assert seeded_effect_id() in effects
    assert seeded_effect_id() not in client.get("/admin/jobs/effect/?q=reviewer52").content.decode()


def test_search__a_job_by_the_uid_in_an_object_name(demo):  # noqa: F811
    """An operator holding an object name (``job-<uid>-rev-29-...``) finds its job."""
    run_delivery(84)
    job = Job.objects.get(pk=84)
    client = login(demo, "operator")
    found = client.get(f"/admin/jobs/job/?q={job.uid}").content.decode()
    assert set(re.findall(r"/admin/jobs/job/(\d+)/change/", found)) == {"84"}
    assert str(job.uid) in client.get("/admin/jobs/job/84/change/").content.decode()


# --- issue 32: the verdict sees what stops work, recovers, names one subject --------------


def _deliver(job, times: int = 1) -> None:
    for _ in range(times):
        Job.objects.filter(pk=job.pk).update(next_attempt_at=job.created_at)
        run_delivery(job.pk)


def _travel(seconds: float) -> None:
    """Every try finished ``seconds`` earlier (the window passes without waiting)."""
    shift = timedelta(seconds=seconds)
    Attempt.objects.update(started_at=F("started_at") - shift, finished_at=F("finished_at") - shift)
    Job.objects.update(finished_at=F("finished_at") - shift, updated_at=F("updated_at") - shift)


def test_health__one_subject_failing_every_try_is_named_not_the_system():
    ok = failing_job(2)
    Job.objects.filter(pk=ok.pk).update(params={})
    _deliver(ok)
    job = failing_job(1)
    _deliver(job, 2)
    health = console.health(console.snapshot())
    assert health.status == "degraded", [(r.key, r.level, r.text) for r in health.reasons]
    named = {r.key: r for r in health.reasons}["one-subject"]
    assert named.text.startswith("1 user fails every try: auth.user:1 (2 in the last 5 min)")
    assert named.href.endswith(f"/admin/jobs/job/{job.pk}/change/")
    assert {r.key: r.level for r in health.reasons}["failure-rate"] == "ok"  # 0 of the 1 other
    assert [j.pk for j, same in console.snapshot().retrying_same] == [job.pk], "listed"


def test_health__recovering_after_the_fix_then_healthy_when_the_window_passed(settings):
    settings.JOBS_CONSOLE_WINDOW_SECONDS = 60
    one, two = failing_job(1), failing_job(2)
    _deliver(one)
    _deliver(two)
    assert console.health(console.snapshot()).status == "failing", "two subjects: the system"
    Job.objects.filter(pk__in=[one.pk, two.pk]).update(params={})  # the fix
    _deliver(one)
    health = console.health(console.snapshot())
    assert health.status == "recovering", [(r.key, r.level, r.text) for r in health.reasons]
    assert health.reasons[0].key == "recovering"
    assert "No try has failed since" in health.reasons[0].text and "1 succeeded since" in (
        health.reasons[0].text
    )
    _deliver(two)
    _travel(61)  # the window has passed the last failure
    health = console.health(console.snapshot())
    assert health.status == "healthy", [(r.key, r.level, r.text) for r in health.reasons]
    assert "in the last 1 min" in {r.key: r.text for r in health.reasons}["failure-rate"]


def test_health__a_pause_and_an_open_circuit_come_first_with_their_action(demo):  # noqa: F811
    from jobs import flow
    from jobs.models import FlowRule

    flow.pause("provider:webhook", actor="test")
    FlowRule.objects.filter(scope="provider:webhook").update(
        circuit_state=FlowRule.Circuit.OPEN, circuit_opened_at=Now()
    )
    health = console.health(console.snapshot())
    assert health.status == "failing"
    first, second = health.reasons[:2]
    assert (first.key, first.action, first.scope) == ("paused", "resume", "provider:webhook")
    assert first.text.startswith("provider:webhook is paused since")
    assert second.key == "circuit" and second.text.startswith("Provider webhook: circuit open")
    assert second.href.endswith("/admin/jobs/effect/?provider__exact=webhook")
    page = login(demo, "operator").get("/admin/jobs/job/dashboard/").content.decode()
    reasons = page[page.index('id="console-health"') : page.index('id="failures-title"')]
    assert reasons.index('data-reason="paused"') < reasons.index('data-reason="circuit"')
    assert "Resume provider:webhook</button>" in reasons, "the operator is offered Resume"
    assert "Open webhook&#x27;s effects</a>" in reasons


def test_console__operator_resumes_after_a_confirmation_and_it_is_audited(demo):  # noqa: F811
    from jobs import flow
    from jobs.models import FlowRule, FlowRuleChange

    flow.pause("provider:webhook", actor="cli:ops")
    client = login(demo, "operator")
    assert "Flow rules" in client.get("/admin/").content.decode(), "on the operators' index"
    url = "/admin/jobs/flowrule/toggle/"
    asked = client.post(url, {"scope": "provider:webhook", "action": "resume"})
    assert asked.status_code == 200 and "Resume provider:webhook?" in asked.content.decode()
    assert FlowRule.objects.get(scope="provider:webhook").paused
    done = client.post(
        url, {"scope": "provider:webhook", "action": "resume", "confirmed": "yes"}, follow=True
    )
    assert "Resumed provider:webhook (the rule now: no limit (defaults))." in done.content.decode()
    assert not FlowRule.objects.get(scope="provider:webhook").paused
    change = FlowRuleChange.objects.latest("id")
    assert (change.action, change.actor, change.before) == ("resume", "operator:operator", "paused")
    edit = client.get(f"/admin/jobs/flowrule/{FlowRule.objects.get().pk}/change/")
    assert edit.status_code == 200, "operators may change limits"


def test_console__no_control_offered_without_the_permission(make_user, client):
    from django.contrib.auth.models import Permission

    from jobs import flow

    flow.pause("provider:webhook", actor="test")
    viewer = make_user(is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(viewer)
    page = client.get("/admin/jobs/job/dashboard/").content.decode()
    assert 'data-reason="paused"' in page
    assert "admin/jobs/flowrule/toggle/" not in page and "/admin/jobs/flowrule/" not in page


def test_health__a_queue_no_worker_claims_from_is_named():
    import jobs

    job = jobs.request("test.short", ("auth.user", 7), queue="reports").job
    Job.objects.filter(pk=job.pk).update(next_attempt_at=Now() - timedelta(minutes=3))
    health = console.health(console.snapshot())
    idle = {r.key: r for r in health.reasons}["queue-idle"]
    assert idle.level == "bad" and idle.text.startswith("Queue reports: 1 due, the oldest")
    assert idle.command == "manage.py jobs_worker --queue reports"
    assert idle.text.endswith("Start one with manage.py jobs_worker --queue reports")
    assert [(q.name, q.due, q.claimed_recently) for q in console.snapshot().queues] == [
        ("reports", 1, False)
    ]


def test_trends__failed_tries_and_the_first_wait_per_minute(client, admin_user):
    from jobs.ops import trends

    job = failing_job(1)
    _deliver(job)  # one failed try this minute
    waiting = failing_job(2)  # never tried: it waits for a first try
    Job.objects.filter(pk=waiting.pk).update(created_at=Now() - timedelta(minutes=3))
    found = {t.key: t for t in trends.trends()}
    assert found["failed-tries"].values[-1] == 1 and sum(found["failed-tries"].values) == 1
    assert found["queue-depth"].values[-1] == 1, "the tried job no longer waits for a first try"
    assert found["queue-depth"].values[-5] == 0, "it did not exist yet four minutes ago"
    assert found["oldest-wait"].values[-1] >= 180
    assert len(found["oldest-wait"].points.split()) == trends.TREND_MINUTES
    client.force_login(admin_user)
    page = client.get("/admin/jobs/job/dashboard/?part=live").content.decode()
    assert 'data-trend="queue-depth"' in page and "Jobs waiting for a first try" in page
