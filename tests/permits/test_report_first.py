"""Report-first review (issue 21): reports asked for by the writes that need them, the
decision gated on the ready report, the queue's views, plain failure summaries."""

from __future__ import annotations

import io
import re

import pytest
from django.core.management import call_command

from jobs import services as job_services
from jobs.delivery.runner import run_delivery
from jobs.models import Attempt, Job
from permits import selectors, services
from permits.models import PermitRequest, ReviewDecision
from tests.permits.factories import permit
from tests.permits.test_views import client_for

pytestmark = pytest.mark.django_db
IN_REVIEW = PermitRequest.Status.IN_REVIEW


@pytest.fixture
def reviewer(make_user):
    return make_user(username="rev-first")


def test_ensure_report__assigning_a_request_in_review_asks_for_its_report(reviewer):
    p = permit(status=IN_REVIEW)
    assert selectors.report_job(p) is None
    services.assign_reviewer(p, reviewer)
    job = selectors.report_job(p)
    assert job is not None and job.state == Job.State.QUEUED


def test_ensure_report__entering_review_asks_once_and_a_submitted_request_waits(reviewer):
    p = permit(reviewer=reviewer)  # submitted: not in review yet
    assert selectors.report_job(p) is None
    job, created = services.enter_review(p)
    again, created_again = services.enter_review(p)
    assert created and not created_again and job.pk == again.pk
    p.status = PermitRequest.Status.APPROVED
    assert services.ensure_report(p) == (None, False)  # decided: no report asked


def test_seed_demo__every_request_in_review_has_its_report_requested():
    call_command("seed_demo", stdout=io.StringIO())
    for p in PermitRequest.objects.all():
        job = selectors.report_job(p)
        assert job is not None, p.reference
    assert selectors.report_job(PermitRequest.objects.get(pk=7)).pk == 84


def test_decision__form_disabled_until_the_report_is_ready_and_says_why(reviewer):
    p = permit(reviewer=reviewer, status=IN_REVIEW)
    client = client_for(reviewer)
    page = client.get(f"/requests/{p.pk}/").content.decode()
    assert re.search(r'id="decision-gate"[^>]* disabled', page)
    assert "You can decide once the report of revision 1 is ready" in page
    assert "being prepared now" in page
    assert 'id="rebuild-report"' not in page  # no rebuild while the report is prepared
    refused = client.post(
        f"/requests/{p.pk}/decisions/", {"decision": "approve", "revision": 1}
    ).content.decode()
    assert "There is a problem" in refused and not ReviewDecision.objects.exists()
    run_delivery(selectors.report_job(p).pk)
    page = client.get(f"/requests/{p.pk}/").content.decode()
    assert not re.search(r'id="decision-gate"[^>]* disabled', page)
    assert 'id="rebuild-report"' in page and 'id="open-report"' in page


def test_generate__only_for_a_cancelled_report_and_builds_the_next_revision(reviewer):
    p = permit(reviewer=reviewer, status=IN_REVIEW)
    job = selectors.report_job(p)
    client = client_for(reviewer)
    assert "Generate report" not in client.get(f"/requests/{p.pk}/").content.decode()
    job_services.cancel_job(job, operator="op")
    page = client.get(f"/requests/{p.pk}/").content.decode()
    assert "Generate report again as revision 2" in page
    assert "an operator cancelled it" in page
    client.post(f"/requests/{p.pk}/report/generate/", {"seen_revision": 1})
    client.post(f"/requests/{p.pk}/report/generate/", {"seen_revision": 1})  # double submit
    p.refresh_from_db()
    assert p.output_revision == 2
    assert selectors.report_job(p).state == Job.State.QUEUED


def test_queue__to_do_and_decided_views_search_and_sort(reviewer):
    open_one = permit(reviewer=reviewer, status=IN_REVIEW, reference="Q-OPEN-1")
    permit(reviewer=reviewer, status=IN_REVIEW, reference="Q-OPEN-2")
    permit(reviewer=reviewer, status=PermitRequest.Status.APPROVED, reference="Q-DONE-1")
    client = client_for(reviewer)
    todo = client.get("/").content.decode()
    assert "Q-OPEN-1" in todo and "Q-OPEN-2" in todo and "Q-DONE-1" not in todo
    decided = client.get("/?view=decided").content.decode()
    assert "Q-DONE-1" in decided and "Q-OPEN-1" not in decided
    found = client.get("/?q=open-2").content.decode()
    assert "Q-OPEN-2" in found and "Q-OPEN-1" not in found
    oldest = client.get("/?sort=oldest").content.decode()
    assert oldest.index("Q-OPEN-1") < oldest.index("Q-OPEN-2")
    newest = client.get("/").content.decode()
    assert newest.index("Q-OPEN-2") < newest.index("Q-OPEN-1")
    assert open_one.reference in newest


def test_failed_report__one_plain_summary_then_the_operators_action(reviewer):
    p = permit(reviewer=reviewer)
    job, _ = services.report_request(p)
    for n in range(1, 4):
        Attempt.objects.create(
            job=job,
            number=n,
            worker="w:1:a",
            outcome="retry" if n < 3 else "dead",
            error_class="unknown",
            finished_at=job.created_at,
        )
    Job.objects.filter(pk=job.pk).update(state=Job.State.DEAD, attempts=3, max_attempts=3)
    job.refresh_from_db()
    page = client_for(reviewer).get(f"/requests/{p.pk}/").content.decode()
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))
    assert "We tried 3 times" in text and "could not build it" in text
    assert "Being prepared again" not in text and "Interrupted" not in text
    job_services.requeue_job(job, operator="op")
    text = re.sub(r"<[^>]+>", " ", client_for(reviewer).get(f"/requests/{p.pk}/").content.decode())
    assert "An operator asked for it again at" in text
    assert "op" not in re.findall(r"asked for it again at [^<]*", text)[0]  # no operator names


def test_404__unknown_url_shows_the_site_page_also_with_debug_on(reviewer, settings):
    settings.DEBUG = True
    response = client_for(reviewer).get("/no-such-page/")
    assert response.status_code == 404
    page = response.content.decode()
    assert "Not found" in page and "Back to my queue" in page and "DEBUG = True" not in page


@pytest.mark.parametrize("debug", [False, True], ids=["production", "demo"])
def test_500__an_error_in_a_view_shows_the_site_page_with_debug_on_or_off(
    reviewer, settings, debug, caplog
):
    settings.DEBUG = debug
    settings.ROOT_URLCONF = "tests.permits.urls_boom"
    response = client_for(reviewer, raise_request_exception=False).get("/boom/")
    assert response.status_code == 500
    page = response.content.decode()
    assert "Sorry, something went wrong" in page and "Back to my queue" in page
    assert "permits.css" in page  # the site's look
    for technical in ("RuntimeError", "private-value", "Traceback", "DEBUG", "NOARCHIVE"):
        assert technical not in page, technical
    # Django logged it, with its traceback, before the page was swapped (for developers).
    assert any(r.name == "django.request" and r.exc_info for r in caplog.records)


@pytest.mark.parametrize("debug", [False, True], ids=["production", "demo"])
def test_404__under_the_admin_leads_back_to_the_admin(make_user, settings, debug):
    settings.DEBUG = debug
    operator = make_user(username="op-404", is_staff=True)
    page = client_for(operator).get("/admin/no-such-page/")
    assert page.status_code == 404
    text = page.content.decode()
    assert 'href="/admin/">Back to the administration' in text and "Back to my queue" not in text
    page = client_for(operator).get("/no-such-page/").content.decode()
    assert "Back to my queue" in page and "Back to the administration" not in page
