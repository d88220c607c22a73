"""The site on the engine's features (issue 44): the report as durable steps with
progress, a reviewer's rebuild ahead of the queue, the reviewers' morning digest as a
periodic kind (one notice per reviewer per day, through the ledger)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.contrib.auth import get_user_model

import jobs
from jobs import schedules
from jobs.models import Artifact, Effect, Job, JobStep, Notice
from permits import digest, services
from permits.models import PermitRequest
from tests.jobs.helpers import run_job, run_queued_effects
from tests.permits.test_admin import demo  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db


def test_report__gather_render_store_as_steps_with_progress(demo):  # noqa: F811
    job = Job.objects.get(pk=84)
    assert run_job(job.pk).outcome == "succeeded"
    job.refresh_from_db()
    steps = list(JobStep.objects.filter(job=job).order_by("id"))
    assert [s.name for s in steps] == ["gather", "render", "store"]
    assert steps[0].output == {"permit": 7, "revision": 29, "office": "springfield"}
    artifact = Artifact.objects.get(job=job)
    assert steps[2].output == {"file": artifact.storage_name, "sha256": artifact.sha256}
    assert steps[1].output == {"sha256": artifact.sha256, "bytes": artifact.size}
    private = PermitRequest.objects.get(pk=7)
    for step in steps:  # references only: nothing of the request's data
        text = str(step.output)
        for value in (private.applicant_phone, private.applicant_name, private.site_address):
            assert value not in text
    assert (job.progress_done, job.progress_total, job.progress_note) == (3, 3, "stored")


def test_report__a_second_attempt_reuses_the_recorded_steps(demo, monkeypatch):  # noqa: F811
    """(Each step recorded at its end, as a step of a second's work is: quick steps ride on
    the next fenced write, jobs.delivery.steps.RIDE_SECONDS.)"""
    from jobs.delivery import steps
    from jobs.delivery.runner import run_delivery

    monkeypatch.setattr(steps, "RIDE_SECONDS", 0.0)

    job = Job.objects.get(pk=84)
    seen = []

    def lose_after_render(stage: str, ctx) -> None:
        seen.append(stage)
        if stage == "step_done:render":
            Job.objects.filter(pk=ctx.job.pk).update(lease_owner="someone-else")

    first = run_job(job.pk, worker="w-1", on_stage=lose_after_render)
    assert first.outcome == "lease_lost"
    names = list(JobStep.objects.filter(job=job).values_list("name", flat=True))
    assert names == ["gather"], "render was not recorded: the fence refused it"
    Job.objects.filter(pk=job.pk).update(lease_expires_at=datetime(2000, 1, 1, tzinfo=UTC))
    second = run_delivery(job.pk, worker="w-2", on_stage=lambda s, c: seen.append(s))
    assert second.outcome == "succeeded"
    assert "step_reused:gather" in seen
    assert list(JobStep.objects.filter(job=job).values_list("name", "attempt")) == [
        ("gather", 1),
        ("render", 2),
        ("store", 2),
    ]


def test_rebuild__a_reviewers_rebuild_goes_ahead_of_the_queue(demo):  # noqa: F811
    reviewer = get_user_model().objects.get(username="reviewer47")
    permit = PermitRequest.objects.get(pk=3)
    current = services.report_request(permit)[0]
    Job.objects.filter(pk=current.pk).update(state=Job.State.SUCCEEDED)
    job, created = services.rebuild_report(permit, reviewer, seen_revision=permit.output_revision)
    assert created and job.priority == services.REBUILD_PRIORITY > 0
    assert current.priority == 0, "reports asked for by review keep the kind's priority"


@pytest.fixture
def digest_scheduled(settings):
    """The digest's schedule as the demo has it (the test settings give it none)."""
    from jobs import registry

    settings.PERMITS_DIGEST_CRON = "0 7 * * 1-5"
    digest.register()
    yield
    settings.PERMITS_DIGEST_CRON = ""
    digest.register()
    assert registry.get_kind(digest.KIND).schedule is None


def test_digest__is_a_periodic_kind_the_console_lists(digest_scheduled, admin_client):
    found, problems = schedules.collect()
    assert digest.KIND in found and not problems
    rows = {row.kind: row for row in schedules.overview()[0]}
    assert digest.KIND in rows
    page = admin_client.get("/admin/jobs/job/dashboard/").content.decode()
    assert digest.KIND in page


def test_digest__no_schedule_without_the_setting():
    from jobs import registry

    assert registry.get_kind(digest.KIND).schedule is None, "the test settings give none"
    assert digest.KIND not in schedules.collect()[0]


def tick_job(day: int) -> Job:
    tick = datetime(2026, 12, day, 7, 0, tzinfo=UTC)
    return jobs.request(digest.KIND, (schedules.SUBJECT_TYPE, schedules.tick_id(tick))).job


def test_digest__one_notice_per_reviewer_per_day_through_the_ledger(demo):  # noqa: F811
    reviewer47 = get_user_model().objects.get(username="reviewer47")
    waiting = digest.waiting_for(reviewer47)
    assert waiting >= 1
    job = tick_job(1)
    assert run_job(job.pk).outcome == "succeeded"
    run_queued_effects()
    mine = Notice.objects.filter(recipient=reviewer47, effect__job=job)
    assert [n.title for n in mine] == [f"Good morning: {waiting} requests wait for your review"]
    # The same day asked again (a second dispatcher, a redelivery): the same job, no
    # second notice.
    assert tick_job(1).pk == job.pk
    run_job(job.pk)
    run_queued_effects()
    assert Notice.objects.filter(recipient=reviewer47, effect__job__kind=digest.KIND).count() == 1
    effects = Effect.objects.filter(job=job, recipient=str(reviewer47.pk))
    assert effects.count() == 1 and effects.get().effect_id.endswith(f":{reviewer47.pk}")
    # The next day: its own job, its own notice.
    assert run_job(tick_job(2).pk).outcome == "succeeded"
    run_queued_effects()
    assert Notice.objects.filter(recipient=reviewer47, effect__job__kind=digest.KIND).count() == 2


def test_digest__says_counts_only_and_skips_reviewers_with_nothing_waiting(demo):  # noqa: F811
    job = tick_job(3)
    run_job(job.pk)
    for effect in Effect.objects.filter(job=job):
        text = str(effect.data)
        assert "wait for your review" in text and "@" not in text and "+1 555" not in text
    idle = get_user_model().objects.create_user("idle-reviewer")
    from django.contrib.auth.models import Group

    idle.groups.add(Group.objects.get(name="reviewers"))
    assert digest.waiting_for(idle) == 0
    assert not Effect.objects.filter(job=job, recipient=str(idle.pk)).exists()


def test_seed_demo__asks_for_the_digests_latest_tick_where_it_is_scheduled(digest_scheduled):
    from io import StringIO

    from django.core.management import call_command

    from jobs.models import ScheduleState

    call_command("seed_demo", stdout=StringIO())
    call_command("seed_demo", stdout=StringIO())
    ticks = Job.objects.filter(kind=digest.KIND)
    assert ticks.count() == 1, "one job for the latest tick, however often the seed runs"
    latest = schedules.collect()[0][digest.KIND].latest_at(schedules.server_now())
    assert ticks.get().subject_id == schedules.tick_id(latest)
    assert ScheduleState.objects.get(kind=digest.KIND).last_tick == latest
    assert not [h for h in schedules.fire_due() if h.created], "the seeded tick is not asked again"
    assert Job.objects.filter(kind=digest.KIND).count() == 1
