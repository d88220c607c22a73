"""Admin: operators see everything, reviewers only their requests, nobody edits engine state."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Group
from django.core.management import call_command

from jobs.delivery.runner import run_delivery
from jobs.models import Job
from permits.models import PermitRequest
from tests.jobs.helpers import request_job


def seeded_effect_id() -> str:
    """The seeded job 84's notice to reviewer47: its id derives from the job's uid."""
    return f"{Job.objects.get(pk=84).uid}:29:completion-notice:47"


pytestmark = pytest.mark.django_db


@pytest.fixture
def demo(client):
    call_command("seed_demo", verbosity=0, stdout=open("/dev/null", "w"))  # noqa: SIM115
    return client


def login(client, username):
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.get(username=username))
    return client


def test_permit_admin__reviewer_sees_only_assigned_requests(demo):
    client = login(demo, "reviewer47")
    page = client.get("/admin/permits/permitrequest/")
    assert page.status_code == 200
    mine = set(
        PermitRequest.objects.filter(pk__in=[1, 2, 3, 4, 5, 7, 8]).values_list(
            "reference", flat=True
        )
    )
    others = set(
        PermitRequest.objects.exclude(reference__in=mine).values_list("reference", flat=True)
    )
    body = page.content.decode()
    assert all(ref in body for ref in mine)
    assert not any(ref in body for ref in others)


def test_permit_admin__other_tenants_request_is_404_for_a_reviewer(demo):
    client = login(demo, "reviewer47")
    assert client.get("/admin/permits/permitrequest/1/change/").status_code == 200
    assert client.get("/admin/permits/permitrequest/10/change/").status_code == 404
    assert client.get("/admin/permits/permitrequest/9999/change/").status_code == 404
    assert client.get("/admin/jobs/notice/").status_code == 403
    assert client.get("/admin/jobs/job/84/change/").status_code == 403


def test_permit_admin__reviewer_cannot_edit_a_request(demo):
    client = login(demo, "reviewer47")
    response = client.post("/admin/permits/permitrequest/1/change/", {"reference": "X"})
    assert response.status_code == 403
    assert PermitRequest.objects.get(pk=1).reference != "X"


def test_permit_admin__operator_sees_all_and_the_current_report(demo):
    run_delivery(84)
    client = login(demo, "operator")
    body = client.get("/admin/permits/permitrequest/").content.decode()
    assert all(ref in body for ref in PermitRequest.objects.values_list("reference", flat=True))
    detail = client.get("/admin/permits/permitrequest/7/change/").content.decode()
    assert "job 84, revision 29: Succeeded" in detail
    assert "/admin/jobs/job/84/change/" in detail


def test_job_admin__operator_sees_attempts_and_effects_but_cannot_edit(demo):
    run_delivery(84)
    client = login(demo, "operator")
    page = client.get("/admin/jobs/job/84/change/").content.decode()
    assert seeded_effect_id() in page and "succeeded" in page
    response = client.post("/admin/jobs/job/84/change/", {"state": "queued"})
    assert response.status_code == 403
    assert Job.objects.get(pk=84).state == Job.State.SUCCEEDED


def test_job_admin__requeue_action_revives_a_dead_job_through_transitions(demo):
    job = dead_job()
    client = login(demo, "operator")
    # First the confirmation: how many, and a sample with their errors; nothing changed yet.
    confirm = client.post(
        "/admin/jobs/job/?state__exact=dead", {"action": "requeue", "_selected_action": [job.pk]}
    ).content.decode()
    assert 'id="bulk-count">1<' in confirm and 'id="bulk-sample"' in confirm
    assert "temporary" in confirm and 'name="confirmed" value="yes"' in confirm
    assert Job.objects.get(pk=job.pk).state == Job.State.DEAD
    response = client.post(
        "/admin/jobs/job/?state__exact=dead",
        {"action": "requeue", "_selected_action": [job.pk], "confirmed": "yes"},
        follow=True,
    )
    assert "Requeued 1 of 1 selected." in response.content.decode()
    # One entry for the object, one summary for the bulk action (no object, the filter named).
    from django.contrib.admin.models import LogEntry

    (summary,) = bulk_summaries()
    assert summary.object_repr == "Bulk requeue: 1 job (state=dead)"
    assert summary.user.username == "operator" and summary.is_change()
    assert "1 of 1 selected done" in summary.change_message
    assert LogEntry.objects.filter(object_id=str(job.pk)).count() == 1
    listing = client.get("/admin/jobs/job/").content.decode()
    assert 'id="bulk-log"' in listing and "Bulk requeue: 1 job (state=dead)" in listing
    job.refresh_from_db()
    # The budget grows on top of the attempts made (attempt numbers never repeat).
    assert (job.state, job.attempts, job.version) == (Job.State.QUEUED, 3, 7)
    assert job.max_attempts > job.attempts
    assert list(job.events.values_list("action", "actor")) == [("requeue", "operator:operator")]


def bulk_summaries(model: str = "job"):
    """The object-less LogEntry rows: one per bulk action."""
    from django.contrib.admin.models import LogEntry

    return list(LogEntry.objects.filter(object_id=None, content_type__model=model).order_by("id"))


def test_bulk_cancel__one_summary_over_the_filter_with_no_private_words(demo):
    from django.contrib.admin.models import LogEntry

    jobs = [
        request_job(
            "test.short", subject_type="auth.user", subject_id=n, params={"secret": "s3cr3t"}
        )[0]
        for n in (1, 2, 3)
    ]
    client = login(demo, "operator")
    url = "/admin/jobs/job/?state__exact=queued&q=test.short"  # a search term is not repeated
    client.post(url, {"action": "cancel", "_selected_action": [j.pk for j in jobs]})
    assert bulk_summaries() == []  # the confirmation page logs nothing
    client.post(
        url,
        {"action": "cancel", "_selected_action": [j.pk for j in jobs], "confirmed": "yes"},
    )
    (summary,) = bulk_summaries()
    assert summary.object_repr == "Bulk cancel: 3 jobs (state=queued, with a search)"
    words = summary.object_repr + summary.change_message
    assert "s3cr3t" not in words and "test.short" not in words
    assert LogEntry.objects.exclude(object_id=None).count() == 3  # one per job
    assert {j.state for j in Job.objects.filter(pk__in=[j.pk for j in jobs])} == {"cancelled"}


def test_groups__exist_after_migrate():
    assert set(Group.objects.values_list("name", flat=True)) >= {"reviewers", "operators"}
    operators = Group.objects.get(name="operators")
    assert operators.permissions.filter(codename="view_job").exists()


# --- the operations console and operator actions ----------------------------------------


def dead_job(subject_id: int = 1) -> Job:
    """A test job that spent its 3 attempts on a temporary failure (a real worker's path)."""
    job = failing_job(subject_id)
    for _ in range(3):
        Job.objects.filter(pk=job.pk).update(next_attempt_at=job.created_at)
        run_delivery(job.pk)
    job.refresh_from_db()
    assert job.state == Job.State.DEAD
    return job


def failing_job(subject_id: int = 1) -> Job:
    """A test job that fails every try, alone in its queue: a delivery may claim a better
    due job of the queue it names than that job (the demo's jobs wait in "default")."""
    import jobs

    return jobs.request(
        "test.short",
        ("auth.user", subject_id),
        params={"fail": {"always": "temporary"}},
        queue=f"isolated-{subject_id}",
    ).job


def tile_counts(page: str, model: str) -> dict[str, int]:
    pattern = rf'href="/admin/jobs/{model}/\?state__exact=(\w+)">.*?console-tile__n">(\d+)<'
    return {state: int(n) for state, n in re.findall(pattern, page, re.S)}


def test_console__counts_match_the_database_zeros_included(demo):
    from django_q.models import OrmQ

    from jobs.models import EFFECT_STATES, JOB_STATES, Effect

    run_delivery(84)
    dead_job()
    request_job("test.short", subject_type="auth.user", subject_id=2)  # queued: its row
    Effect.objects.filter(job_id=84).update(state=Effect.State.NEEDS_REVIEW)
    client = login(demo, "operator")
    page = client.get("/admin/jobs/job/dashboard/").content.decode()
    jobs = tile_counts(page, "job")
    effects = tile_counts(page, "effect")
    assert list(jobs) == JOB_STATES and list(effects) == EFFECT_STATES  # every state, in order
    assert jobs == {s: Job.objects.filter(state=s).count() for s in JOB_STATES}
    assert effects == {s: Effect.objects.filter(state=s).count() for s in EFFECT_STATES}
    assert jobs["dead"] == 1 and jobs["running"] == 0 and effects["needs_review"] >= 1
    depth = re.search(r'id="queue-depth"><a [^>]*>(\d+)</a>', page).group(1)
    # The waiting and running jobs are the queue (no message each), with any plain tasks.
    in_table = Job.objects.filter(state__in=["queued", "retry_wait", "running"]).count()
    assert not OrmQ.objects.exists(), "no engine job has a django_q_ormq row"
    assert int(depth) == in_table > 0
    assert seeded_effect_id() in page  # listed under "needs review"
    assert 'id="workers"' in page and "<polyline" in page
    live = client.get("/admin/jobs/job/dashboard/?part=live").content.decode()
    assert "<html" not in live and tile_counts(live, "job") == jobs  # the refreshing part


def test_console__no_inline_script_or_style(demo):
    client = login(demo, "operator")
    page = client.get("/admin/jobs/job/dashboard/").content.decode()
    assert "<style" not in page and " style=" not in page
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", page)


def test_job_page__action_buttons_run_the_transition_and_log_who(demo):
    from django.contrib.admin.models import LogEntry

    job = dead_job()
    client = login(demo, "operator")
    page = client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    url = f"/admin/jobs/job/{job.pk}/operate/requeue/"
    assert f'href="{url}"' in page and 'id="operate-requeue"' in page
    assert "operate-cancel" not in page  # only what applies to a dead job
    # The button leads to a confirmation with a preview; a GET changes nothing.
    confirm = client.get(url).content.decode()
    assert (
        f"Requeue job {job.pk} (dead, temporary" in confirm
        and "on 3 of its tries; tries 3 of 3" in confirm
    )
    job.refresh_from_db()
    assert job.state == Job.State.DEAD
    response = client.post(url, follow=True)
    assert response.redirect_chain[-1][0].endswith("?follow=1")  # the page follows the outcome
    assert "Requeue: done for job" in response.content.decode()
    assert 'id="jobs-follow"' in response.content.decode()
    followed = client.get(f"/admin/jobs/job/{job.pk}/follow/").json()
    assert followed == {
        "state": "queued",
        "settled": False,
        "text": f"Now queued, 3 of {job.max_attempts + 3} attempts used.",
        "progress": "—",
        "state_word": "Waiting",  # a test.short job: the app's neutral word
    }
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED
    entry = LogEntry.objects.get(object_id=str(job.pk))
    assert entry.user.username == "operator" and entry.is_change()
    assert "Requeue: dead → queued" in entry.get_change_message()
    assert (
        "Requeue: dead → queued" in client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    )
    again = client.post(url, follow=True).content.decode()  # now it is queued: said why
    assert "not done, job" in again and "is queued; Requeue applies to failed or dead ones" in again
    assert LogEntry.objects.filter(object_id=str(job.pk)).count() == 1
    assert LogEntry.objects.count() == 1 and bulk_summaries() == []  # no bulk summary


def test_job_list_action__says_why_it_did_nothing_and_logs_what_it_did(demo):
    from django.contrib.admin.models import LogEntry

    run_delivery(84)
    dead = dead_job()
    client = login(demo, "operator")
    response = client.post(
        "/admin/jobs/job/",
        {"action": "requeue", "_selected_action": [84, dead.pk], "confirmed": "yes"},
        follow=True,
    )
    text = response.content.decode()
    assert "Requeued 1 of 2 selected." in text
    assert "job 84 is succeeded; Requeue applies to failed or dead ones" in text
    assert list(
        LogEntry.objects.exclude(object_id=None).values_list("object_id", "user__username")
    ) == [(str(dead.pk), "operator")]
    (summary,) = bulk_summaries()  # one summary, counting what was done
    assert summary.object_repr == "Bulk requeue: 1 job"
    assert "1 of 2 selected done, 1 not" in summary.change_message


def test_job_actions__need_the_change_permission(demo, make_user):
    from django.contrib.auth.models import Permission

    job = dead_job()
    viewer = make_user(username="viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_job"))
    for user in ("reviewer47", viewer.username):
        client = login(demo, user)
        assert client.post(f"/admin/jobs/job/{job.pk}/operate/requeue/").status_code == 403
        if user == viewer.username:
            page = client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
            assert "operate-requeue" not in page and "actions need the change permission" in page
    job.refresh_from_db()
    assert job.state == Job.State.DEAD


def test_job_page__attempt_numbers_continue_across_a_requeue(demo):
    from jobs.services import requeue_job

    job = dead_job()
    requeue_job(job)
    Job.objects.filter(pk=job.pk).update(next_attempt_at=job.created_at)
    run_delivery(job.pk)  # the first try of the new budget: Attempt.number goes on to 4
    client = login(demo, "operator")
    page = client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    tries = re.findall(r'<td class="field-try_number">\s*<p>(\d+)</p>', page)
    budget = re.findall(r'<td class="field-in_budget">\s*<p>(\d+)</p>', page)
    assert tries == ["1", "2", "3", "4"] and budget == ["1", "2", "3", "4"]
    assert "test dependency unavailable" in page  # the last error's detail
    assert page.count("temporary") >= 4  # each attempt's error class


def test_job_page__links_to_its_permit_and_search_finds_it_by_reference(demo):
    client = login(demo, "operator")
    page = client.get("/admin/jobs/job/84/change/").content.decode()
    assert '<a href="/admin/permits/permitrequest/7/change/">SPR-2026-0007</a> r29' in page
    dead_job()
    found = client.get("/admin/jobs/job/", {"q": "SPR-2026-0007"}).content.decode()
    assert re.findall(r'<th class="field-id"><a href="/admin/jobs/job/(\d+)/change/', found) == [
        "84"
    ]
    assert client.get("/admin/jobs/job/", {"q": "SPR-2026-0099"}).context["cl"].result_count == 0


def test_effect_page__buttons_for_needs_review_and_the_history_inline(demo):
    from django.contrib.admin.models import LogEntry

    from jobs.models import Effect, EffectEvent

    run_delivery(84)
    effect = Effect.objects.get(job_id=84)
    Effect.objects.filter(pk=effect.pk).update(state=Effect.State.NEEDS_REVIEW)
    client = login(demo, "operator")
    page = client.get(f"/admin/jobs/effect/{effect.pk}/change/").content.decode()
    assert 'id="operate-mark_sent"' in page and 'id="operate-send_again"' in page
    assert "History (sends and operator actions" in page  # the EffectEvent inline is visible
    client.post(f"/admin/jobs/effect/{effect.pk}/operate/mark_sent/")
    effect.refresh_from_db()
    assert effect.state == Effect.State.APPLIED
    assert EffectEvent.objects.filter(effect=effect, actor="operator:operator").exists()
    assert LogEntry.objects.get(object_id=str(effect.pk)).user.username == "operator"
    assert LogEntry.objects.count() == 1 and bulk_summaries("effect") == []  # no bulk summary


def test_operators__read_effect_events_and_the_task_queue_but_change_nothing(demo):
    run_delivery(84)
    client = login(demo, "operator")
    for url in (
        "/admin/jobs/effectevent/",
        "/admin/django_q/ormq/",
        "/admin/django_q/success/",
        "/admin/django_q/failure/",
        "/admin/django_q/schedule/",
    ):
        assert client.get(url).status_code == 200, url
    events = client.get("/admin/jobs/effectevent/").content.decode()
    assert seeded_effect_id() in events
    from django_q.models import OrmQ
    from django_q.tasks import async_task

    request_job("test.short", subject_type="auth.user", subject_id=3)
    assert not OrmQ.objects.exists(), "an engine job has no message"
    async_task("math.floor", 1.5)  # a plain django-q2 task keeps its message
    message = OrmQ.objects.get()
    response = client.post(f"/admin/django_q/ormq/{message.pk}/change/", {"key": "x"})
    assert response.status_code == 403
    assert client.post(f"/admin/django_q/ormq/{message.pk}/delete/").status_code == 403
    success = client.get("/admin/django_q/success/")
    assert "resubmit_task" not in success.content.decode()  # needs the change permission
    reviewer = login(demo, "reviewer47")
    assert reviewer.get("/admin/jobs/effectevent/").status_code == 403
    assert reviewer.get("/admin/django_q/ormq/").status_code == 403


# --- issue 32, item 4: the cause in plain words, and the way to fix it and back ------------


def _change_form_data(page) -> dict:
    """What the change form would post back unchanged (its fields and inline formsets)."""

    def value(bound):
        got = bound.value()
        if isinstance(got, bool):
            return "on" if got else ""
        return "" if got is None else got

    form = page.context["adminform"].form
    data = {form.add_prefix(name): value(form[name]) for name in form.fields}
    for inline in page.context["inline_admin_formsets"]:
        formset = inline.formset
        management = formset.management_form
        data.update({management.add_prefix(n): value(management[n]) for n in management.fields})
        for sub in formset.forms:
            data.update({sub.add_prefix(n): value(sub[n]) for n in sub.fields})
    return {k: v for k, v in data.items() if v != ""}


def test_dead_report__bad_value_shown__fix_the_subject_and_back_to_the_job(demo):
    from permits.reports import KIND

    job = Job.objects.filter(kind=KIND, state=Job.State.QUEUED).order_by("pk").first()
    permit = PermitRequest.objects.get(pk=job.subject_id)
    PermitRequest.objects.filter(pk=permit.pk).update(work_type="pool")  # not a choice
    for _ in range(40):  # a delivery may claim another due job of the queue first
        Job.objects.filter(pk=job.pk).update(next_attempt_at=job.created_at)
        run_delivery(job.pk)
        job.refresh_from_db()
        if job.state == Job.State.DEAD:
            break
    assert job.state == Job.State.DEAD and job.last_error_code == "work_type_invalid"
    client = login(demo, "operator")
    page = client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    # The cause in words (issue 44), no exception class needed to understand it.
    assert "The request&#x27;s work type is not one of the valid choices" in page
    assert "Correct the work type on the request (Fix the subject), then requeue" in page
    fix = f"/admin/permits/permitrequest/{permit.pk}/change/?_job={job.pk}"
    assert f'href="{fix}" id="fix-subject">Fix the subject<' in page
    assert f"{job.attempts} of {job.max_attempts}" in page
    form = client.get(fix)
    text = form.content.decode()
    assert '<option value="pool" selected>pool (not a valid choice)</option>' in text
    assert "is not a valid choice: choose one of the others" in text
    data = _change_form_data(form)
    assert data["work_type"] == "pool"
    refused = client.post(fix, data)
    assert refused.status_code == 200 and "not a valid choice" in refused.content.decode()
    saved = client.post(fix, {**data, "work_type": "alteration"})
    assert saved.status_code == 302, saved.content.decode()[-2000:]
    assert saved["Location"] == f"/admin/jobs/job/{job.pk}/change/", "back to the job"
    assert PermitRequest.objects.get(pk=permit.pk).work_type == "alteration"
    back = client.get(saved["Location"]).content.decode()
    assert f"Back to job {job.pk}: retry it now." in back
    assert f'/admin/jobs/job/{job.pk}/operate/requeue/"' in back
