"""Reviewer pages: access by object permission (404 otherwise), downloads, forms, notices."""

from __future__ import annotations

import hashlib
import io
import re
from decimal import Decimal
from itertools import count

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from jobs.delivery.runner import run_delivery
from jobs.models import Artifact, Job, Notice
from permits import selectors
from permits.models import PermitRequest, ReviewDecision, Tenant
from permits.services import assign_reviewer, report_request, revoke_reviewer
from tests.jobs.helpers import run_queued_effects

pytestmark = pytest.mark.django_db

PRIVATE = {
    "applicant_name": "Ottilie Vantongeren",
    "applicant_phone": "+1 555 0142",
    "applicant_email": "ottilie.v@example.net",
    "applicant_id_number": "ZK-5521-0087",
}
_n = count(1)
QUEUE_QUERIES = 7  # ... and the To do / Decided counts


def office(key: str = "alpha") -> Tenant:
    return Tenant.objects.get_or_create(key=key, defaults={"name": f"{key.title()} Office"})[0]


def permit(tenant: Tenant | None = None, *, reviewer=None, **fields) -> PermitRequest:
    n = next(_n)
    made = PermitRequest.objects.create(
        tenant=tenant or office(),
        reference=f"VW-{n:05d}",
        site_address=f"{n} View Street",
        parcel=f"P-{n}",
        work_type=PermitRequest.WorkType.ALTERATION,
        description="Interior alteration",
        valuation=Decimal("32000"),
        **{**PRIVATE, **fields},
    )
    if reviewer is not None:
        assign_reviewer(made, reviewer)
    return made


def finished_report(p: PermitRequest) -> Job:
    """Build the current revision's report synchronously, as a worker would."""
    job, _ = report_request(p)
    assert run_delivery(job.pk).outcome == "succeeded"
    job.refresh_from_db()
    return job


def client_for(user, **kwargs) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


def body(response) -> bytes:
    """The streamed bytes; reading to the end closes the file (the test client's wrapper)."""
    return b"".join(response.streaming_content)


@pytest.fixture
def reviewer(make_user):
    return make_user(username="rev-a")


@pytest.fixture
def other_reviewer(make_user):
    return make_user(username="rev-b")


# --- queue -------------------------------------------------------------------------


def test_queue__lists_only_assigned_requests():
    call_command("seed_demo", stdout=io.StringIO())
    reviewer47 = get_user_model().objects.get(username="reviewer47")
    response = client_for(reviewer47).get("/")
    assert response.status_code == 200
    shown = set(re.findall(r"SPR-2026-\d{4}|SHE-2026-\d{4}", response.content.decode()))
    assert shown == {f"SPR-2026-{pk:04d}" for pk in (1, 2, 3, 4, 5, 7, 8)}


def test_queue__newest_first_and_paginated(reviewer):
    made = [permit(reviewer=reviewer) for _ in range(12)]
    for i, p in enumerate(made):  # submitted one hour apart: the last is the newest
        PermitRequest.objects.filter(pk=p.pk).update(
            submitted_at=p.submitted_at.replace(year=2026, month=1, day=1, hour=i)
        )
    client = client_for(reviewer)
    first = client.get("/").content.decode()
    second = client.get("/?page=2").content.decode()
    refs_first = re.findall(r"VW-\d{5}", first)
    refs_second = re.findall(r"VW-\d{5}", second)
    assert refs_first == [p.reference for p in reversed(made[2:])]
    assert refs_second == [p.reference for p in reversed(made[:2])]
    assert "Page 1 of 2" in first


def test_queue__shows_each_report_state_in_words(reviewer):
    ready = permit(reviewer=reviewer)
    queued = permit(reviewer=reviewer)
    permit(reviewer=reviewer)
    finished_report(ready)
    report_request(queued)
    page = client_for(reviewer).get("/").content.decode()
    assert page.count("badge--ready") == 1
    assert page.count("badge--queued") == 1
    assert page.count("badge--none") == 1


def test_queue__query_count_does_not_grow_with_rows(reviewer, django_assert_max_num_queries):
    # session, user, count, page of requests, their report jobs (one query), unread notices
    client = client_for(reviewer)
    finished_report(permit(reviewer=reviewer))
    client.get("/")  # warm the content-type cache
    with django_assert_max_num_queries(QUEUE_QUERIES):
        assert client.get("/").status_code == 200
    for _ in range(11):
        report_request(permit(reviewer=reviewer))
    with django_assert_max_num_queries(QUEUE_QUERIES):
        response = client.get("/")
    assert response.status_code == 200
    assert response.content.decode().count('class="ref"') == 10


def test_queue__unread_notice_count_in_header(reviewer):
    finished_report(permit(reviewer=reviewer))
    page = client_for(reviewer).get("/").content.decode()
    assert re.search(r'id="unread-count"[^>]*>1<', page)


# --- access: 404 for what a user may not see ----------------------------------------


def test_pages__other_tenants_request_answers_404(reviewer, other_reviewer):
    mine = permit(office("alpha"), reviewer=reviewer)
    theirs = permit(office("beta"), reviewer=other_reviewer)
    finished_report(theirs)
    client = client_for(reviewer)
    assert client.get(f"/requests/{mine.pk}/").status_code == 200
    for url in (
        f"/requests/{theirs.pk}/",
        f"/requests/{theirs.pk}/status/",
        f"/requests/{theirs.pk}/report/",
        f"/requests/{theirs.pk}/report/?revision=1",
    ):
        assert client.get(url).status_code == 404, url
    for url in (
        f"/requests/{theirs.pk}/revisions/",
        f"/requests/{theirs.pk}/report/generate/",
        f"/requests/{theirs.pk}/decisions/",
    ):
        assert client.post(url, {"seen_revision": 1}).status_code == 404, url
    theirs.refresh_from_db()
    assert theirs.output_revision == 1
    assert not ReviewDecision.objects.exists()


def test_pages__missing_request_looks_like_a_forbidden_one(reviewer, other_reviewer):
    theirs = permit(reviewer=other_reviewer)
    client = client_for(reviewer)
    forbidden = client.get(f"/requests/{theirs.pk}/")
    missing = client.get("/requests/999999/")
    assert forbidden.status_code == missing.status_code == 404
    token = re.compile(rb'name="csrfmiddlewaretoken" value="[^"]+"')
    assert token.sub(b"", forbidden.content) == token.sub(b"", missing.content)


def test_pages__anonymous_is_sent_to_login(reviewer):
    p = permit(reviewer=reviewer)
    client = Client()
    for url in (
        "/",
        f"/requests/{p.pk}/",
        f"/requests/{p.pk}/status/",
        f"/requests/{p.pk}/report/",
        "/notices/",
    ):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith(reverse("login") + "?next="), url
    response = client.post(f"/requests/{p.pk}/revisions/", {"seen_revision": 1})
    assert response.status_code == 302
    p.refresh_from_db()
    assert p.output_revision == 1


def test_login__logs_in_then_logs_out_by_post(reviewer):
    reviewer.set_password("s3cret-pass")
    reviewer.save()
    client = Client(enforce_csrf_checks=True)
    page = client.get(reverse("login"))
    token = page.cookies["csrftoken"].value
    response = client.post(
        reverse("login"),
        {"username": "rev-a", "password": "s3cret-pass", "csrfmiddlewaretoken": token},
    )
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200
    assert client.get(reverse("logout")).status_code == 405  # logging out takes a POST
    token = client.cookies["csrftoken"].value
    assert client.post(reverse("logout"), {"csrfmiddlewaretoken": token}).status_code == 302
    assert client.get("/").status_code == 302


# --- request detail ------------------------------------------------------------------


def test_detail__shows_private_fields_to_the_assigned_reviewer(reviewer):
    p = permit(reviewer=reviewer)
    page = client_for(reviewer).get(f"/requests/{p.pk}/").content.decode()
    for value in PRIVATE.values():
        assert value in page
    assert p.site_address in page and "Not requested" in page


def test_detail__superuser_sees_the_page_but_not_private_fields(make_user):
    operator = make_user(username="root-op", is_superuser=True, is_staff=True)
    p = permit()
    page = client_for(operator).get(f"/requests/{p.pk}/").content.decode()
    assert p.reference in page
    for value in PRIVATE.values():
        assert value not in page
    assert "assigned to this request only" in page


def test_detail__events_in_plain_words_without_engine_details(reviewer, settings):
    settings.NOTICE_PROVIDER_URL = "http://127.0.0.1:9"  # nothing listens: the webhook retries
    p = permit(reviewer=reviewer)
    job = finished_report(p)
    run_delivery(job.pk, worker="web-test:99:abc")  # the queue delivers a second time
    job.refresh_from_db()
    page = client_for(reviewer).get(f"/requests/{p.pk}/").content.decode()
    text = re.sub(r"<[^>]+>", " ", page)
    for words in ("Requested", "Being prepared", "Ready", "Notice to your inbox: delivered"):
        assert words in text, words
    assert "Open report" in page and "Download PDF" in page
    # Operators' vocabulary stays in the admin: no worker ids, keys, hashes or protocol words.
    artifact = Artifact.objects.get(job=job)
    for hidden in ("web-test", job.lease_owner, artifact.sha256[:8], "sha256", "worker"):
        assert hidden not in text, hidden
    for word in ("webhook", "same key", "idempotency", "attempt"):
        assert word not in text.lower(), word


def test_detail__keeps_polling_while_a_notice_is_retrying(reviewer, settings):
    from jobs.models import Effect

    settings.NOTICE_PROVIDER_URL = "http://127.0.0.1:9"  # nothing listens: the webhook retries
    p = permit(reviewer=reviewer)
    job = finished_report(p)
    run_queued_effects()  # a worker tries the webhook notice once: nothing listens
    webhook = Effect.objects.get(job=job, provider="webhook")
    assert webhook.state == Effect.State.PENDING and webhook.attempts == 1
    client = client_for(reviewer)
    page = client.get(f"/requests/{p.pk}/").content.decode()
    assert 'data-finished="false"' in page  # the report is ready, the notice is not
    assert "Notice to your device: delivery retrying" in page
    Effect.objects.filter(pk=webhook.pk).update(state=Effect.State.APPLIED)
    status = client.get(f"/requests/{p.pk}/status/").content.decode()
    assert 'data-finished="true"' in status
    assert "Notice to your device: delivered" in status


def test_detail__without_javascript_offers_check_again_instead_of_a_refresh(reviewer):
    p = permit(reviewer=reviewer)
    job, _ = report_request(p)
    client = client_for(reviewer)
    page = client.get(f"/requests/{p.pk}/").content.decode()
    # No meta refresh: it would reload the page and wipe a half-typed decision.
    assert "http-equiv" not in page.lower()
    assert re.search(rf'<a href="/requests/{p.pk}/">Check again</a>', page)
    run_delivery(job.pk)
    assert "Check again" not in client.get(f"/requests/{p.pk}/").content.decode()


def test_detail__live_region_is_stable_and_only_its_text_changes(reviewer):
    p = permit(reviewer=reviewer)
    job, _ = report_request(p)
    client = client_for(reviewer)
    region = re.compile(r'<p id="report-status"[^>]*>')
    before = client.get(f"/requests/{p.pk}/status/").content.decode()
    run_delivery(job.pk)
    after = client.get(f"/requests/{p.pk}/status/").content.decode()
    assert region.search(before).group(0) == region.search(after).group(0)
    assert 'role="status" aria-live="polite"' in region.search(after).group(0)
    # The panel itself is not a live region: replacing it would not be announced reliably.
    assert "aria-live" not in re.search(r'<section id="report-panel"[^>]*>', after).group(0)


def test_status__fragment_polls_until_finished(reviewer):
    p = permit(reviewer=reviewer)
    job, _ = report_request(p)
    client = client_for(reviewer)
    detail = client.get(f"/requests/{p.pk}/").content.decode()
    assert 'data-finished="false"' in detail and "poll.js" in detail
    pending = client.get(f"/requests/{p.pk}/status/")
    assert pending.status_code == 200
    assert 'data-finished="false"' in pending.content.decode()
    assert "Requested" in pending.content.decode()
    assert pending["X-Unread-Notices"] == "0"
    assert "no-cache" in pending["Cache-Control"]
    run_delivery(job.pk)
    done = client.get(f"/requests/{p.pk}/status/")
    text = done.content.decode()
    assert text.lstrip().startswith('<section id="report-panel"')
    assert 'data-finished="true"' in text and "Ready" in text and "Open report" in text
    assert done["X-Unread-Notices"] == "1"


# --- download ------------------------------------------------------------------------


def test_download__rechecks_permission_on_every_request(reviewer):
    p = permit(reviewer=reviewer)
    job = finished_report(p)
    artifact = Artifact.objects.get(job=job)
    client = client_for(reviewer)

    # Inline by default (the browser's PDF viewer opens it), an attachment on request.
    response = client.get(f"/requests/{p.pk}/report/")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/pdf"
    assert response["Content-Disposition"] == (
        f"inline; filename=\"{p.reference}-r1.pdf\"; filename*=UTF-8''{p.reference}-r1.pdf"
    )
    data = body(response)
    attached = client.get(f"/requests/{p.pk}/report/?download=1")
    assert attached["Content-Disposition"].startswith("attachment; ")
    assert body(attached) == data
    assert data.startswith(b"%PDF")
    assert hashlib.sha256(data).hexdigest() == artifact.sha256

    revoke_reviewer(p, reviewer)
    assert client.get(f"/requests/{p.pk}/report/").status_code == 404
    assert client.get(f"/requests/{p.pk}/").status_code == 404

    assign_reviewer(p, reviewer)
    assert client.get(f"/requests/{p.pk}/report/").status_code == 200


def test_download__404_until_the_report_succeeded(reviewer):
    p = permit(reviewer=reviewer)
    client = client_for(reviewer)
    assert client.get(f"/requests/{p.pk}/report/").status_code == 404
    report_request(p)
    assert client.get(f"/requests/{p.pk}/report/").status_code == 404
    assert client.get(f"/requests/{p.pk}/report/?revision=x").status_code == 404


def test_download__earlier_revision_by_query(reviewer):
    p = permit(reviewer=reviewer)
    first = finished_report(p)
    client = client_for(reviewer)
    client.post(f"/requests/{p.pk}/revisions/", {"seen_revision": 1})
    p.refresh_from_db()
    assert p.output_revision == 2
    assert client.get(f"/requests/{p.pk}/report/").status_code == 404  # r2 not built yet
    response = client.get(f"/requests/{p.pk}/report/?revision=1")
    assert response.status_code == 200
    assert f'filename="{p.reference}-r1.pdf"' in response["Content-Disposition"]
    assert hashlib.sha256(body(response)).hexdigest() == Artifact.objects.get(job=first).sha256


def test_download__missing_file_is_not_served(reviewer):
    p = permit(reviewer=reviewer)
    job = finished_report(p)
    artifact = Artifact.objects.get(job=job)
    from jobs.artifacts import get_storage

    get_storage().delete(artifact.storage_name)
    # A clear page and a restore request (tests/permits/test_security.py), not a 404.
    assert client_for(reviewer).get(f"/requests/{p.pk}/report/").status_code == 503


# --- new revision and decisions --------------------------------------------------------


def test_new_revision__double_submit_bumps_once(reviewer):
    p = permit(reviewer=reviewer)
    client = client_for(reviewer)
    first = client.post(f"/requests/{p.pk}/revisions/", {"seen_revision": 1}, follow=True)
    second = client.post(f"/requests/{p.pk}/revisions/", {"seen_revision": 1}, follow=True)
    p.refresh_from_db()
    assert p.output_revision == 2
    jobs = list(selectors.report_jobs_of(p))
    assert [j.output_revision for j in jobs] == [2]
    assert "Rebuild started: the report is now revision 2" in first.content.decode()
    assert "Revision 2 was already started" in second.content.decode()


def test_new_revision__stale_form_is_refused_readably(reviewer):
    p = permit(reviewer=reviewer)
    response = client_for(reviewer).post(
        f"/requests/{p.pk}/revisions/", {"seen_revision": "abc"}, follow=True
    )
    assert "out of date" in response.content.decode()
    p.refresh_from_db()
    assert p.output_revision == 1


def test_generate__builds_the_current_revision_once(reviewer):
    p = permit(reviewer=reviewer)
    client = client_for(reviewer)
    client.post(f"/requests/{p.pk}/report/generate/")
    client.post(f"/requests/{p.pk}/report/generate/")
    assert [j.output_revision for j in selectors.report_jobs_of(p)] == [1]


def test_decision__invalid_choice_shows_readable_error(reviewer):
    p = permit(reviewer=reviewer)
    response = client_for(reviewer).post(
        f"/requests/{p.pk}/decisions/", {"decision": "maybe", "comment": "", "revision": 1}
    )
    assert response.status_code == 200
    page = response.content.decode()
    assert "“maybe” is not a decision. Choose approve, request changes or reject." in page
    assert not ReviewDecision.objects.exists()


def test_decision__reject_without_comment_asks_for_a_reason(reviewer):
    p = permit(reviewer=reviewer)
    response = client_for(reviewer).post(
        f"/requests/{p.pk}/decisions/", {"decision": "reject", "comment": " ", "revision": 1}
    )
    assert "Say why you reject: the applicant needs a reason." in response.content.decode()
    assert not ReviewDecision.objects.exists()


def test_decision__on_a_stale_revision_is_refused(reviewer):
    p = permit(reviewer=reviewer, output_revision=3)
    response = client_for(reviewer).post(
        f"/requests/{p.pk}/decisions/", {"decision": "approve", "revision": 2}
    )
    assert "moved to revision 3 after you opened revision 2" in response.content.decode()
    assert not ReviewDecision.objects.exists()


def test_decision__records_and_moves_the_status(reviewer):
    p = permit(reviewer=reviewer)
    finished_report(p)  # the decision opens once the report is ready
    response = client_for(reviewer).post(
        f"/requests/{p.pk}/decisions/",
        {"decision": "request_changes", "comment": "Show the setbacks.", "revision": 1},
        follow=True,
    )
    made = ReviewDecision.objects.get()
    assert (made.decision, made.reviewer, made.revision) == ("request_changes", reviewer, 1)
    p.refresh_from_db()
    assert p.status == PermitRequest.Status.CHANGES_REQUESTED
    assert "Decision recorded: “Request changes” on revision 1." in response.content.decode()


def _decide(client, p, **data):
    data.setdefault("revision", p.output_revision)
    return client.post(f"/requests/{p.pk}/decisions/", data, follow=True)


def test_decision__second_submit_does_not_create_a_second(reviewer):
    p = permit(reviewer=reviewer)
    finished_report(p)  # the decision opens once the report is ready
    client = client_for(reviewer)
    first = _decide(client, p, decision="approve")
    again = _decide(client, p, decision="approve")  # a double click, or the back button
    assert ReviewDecision.objects.count() == 1
    assert "Decision recorded: “Approve” on revision 1." in again.content.decode()
    other = _decide(client, p, decision="reject", comment="Too tall.")  # a stale second window
    assert ReviewDecision.objects.count() == 1
    page = other.content.decode()
    assert "There is a problem" in page and "You already recorded “Approve” on revision 1" in page
    # The form kept the typed answers, now aimed at changing the recorded decision.
    assert "Too tall." in page and "Save changed decision" in page
    assert first.status_code == again.status_code == other.status_code == 200


def test_decision__recorded_decision_replaces_the_form_until_the_reviewer_changes_it(reviewer):
    p = permit(reviewer=reviewer)
    finished_report(p)  # the decision opens once the report is ready
    client = client_for(reviewer)
    page = _decide(client, p, decision="approve").content.decode()
    assert 'id="decision-form"' not in page
    assert "Change your decision" in page
    assert 'role="alert"' in page and "data-focus-on-load" in page  # the banner takes focus
    form = client.get(f"/requests/{p.pk}/?change=1").content.decode()
    first = ReviewDecision.objects.get()
    assert f'name="replaces" value="{first.pk}"' in form
    assert re.search(r'value="approve"[^>]*checked', form)


def test_decision__change_is_recorded_as_such_and_the_old_one_kept(reviewer):
    p = permit(reviewer=reviewer)
    finished_report(p)  # the decision opens once the report is ready
    client = client_for(reviewer)
    _decide(client, p, decision="approve")
    first = ReviewDecision.objects.get()
    page = _decide(
        client, p, decision="request_changes", comment="Add setbacks.", replaces=first.pk
    ).content.decode()
    assert "Decision changed to “Request changes” on revision 1." in page
    second = ReviewDecision.objects.exclude(pk=first.pk).get()
    assert second.supersedes == first and second.is_change
    first.refresh_from_db()
    assert first.decision == "approve"  # kept as it was
    assert "changed from Approve" in page and "later changed" in page
    p.refresh_from_db()
    assert p.status == PermitRequest.Status.CHANGES_REQUESTED
    # Changing the old one again (a stale change form) is refused: one change per decision.
    stale = _decide(client, p, decision="reject", comment="No.", replaces=first.pk)
    assert "changed in another window" in stale.content.decode()
    assert ReviewDecision.objects.count() == 2


def test_decision__two_reviewers_each_decide_once(reviewer, other_reviewer):
    p = permit(reviewer=reviewer)
    finished_report(p)  # the decision opens once the report is ready
    assign_reviewer(p, other_reviewer)
    _decide(client_for(reviewer), p, decision="approve")
    _decide(client_for(other_reviewer), p, decision="reject", comment="Height.")
    assert ReviewDecision.objects.count() == 2


def test_decision__errors_follow_the_error_summary_pattern(reviewer):
    p = permit(reviewer=reviewer)
    response = client_for(reviewer).post(
        f"/requests/{p.pk}/decisions/", {"comment": "x" * 4001, "revision": 1}
    )
    page = response.content.decode()
    assert re.search(r"<title>Error: ", page)
    summary = re.search(r'<div class="error-summary"[^>]*>(.*?)</div>', page, re.S)
    assert summary and 'role="alert"' in summary.group(0) and 'tabindex="-1"' in summary.group(0)
    assert "There is a problem" in summary.group(1)
    assert '<a href="#id_decision_0">Choose a decision' in summary.group(1)
    assert '<a href="#id_comment">Keep the comment under 4000 characters.' in summary.group(1)
    # The radio group's fieldset names its message; the textarea names its hint and message.
    fieldset = re.search(r'<fieldset[^>]*id="decision-group"[^>]*>', page).group(0)
    assert 'aria-describedby="decision-hint decision-error"' in fieldset
    assert re.search(r'<p class="field__error" id="decision-error">.*Choose a decision', page)
    textarea = re.search(r"<textarea[^>]*>", page).group(0)
    assert 'aria-describedby="comment-hint comment-error"' in textarea
    assert 'aria-invalid="true"' in textarea
    assert 'id="comment-error"' in page
    assert "x" * 4001 in page  # what was typed is kept
    assert not ReviewDecision.objects.exists()


def test_decision__refused_once_the_applicant_withdrew(reviewer):
    p = permit(reviewer=reviewer)
    client = client_for(reviewer)
    from permits.services import withdraw

    withdraw(p)
    page = _decide(client, p, decision="approve").content.decode()
    assert "The applicant withdrew this request" in page
    assert not ReviewDecision.objects.exists()
    p.refresh_from_db()
    assert p.status == PermitRequest.Status.WITHDRAWN


def test_decide__a_stale_copy_of_a_withdrawn_request_is_not_overwritten(reviewer):
    from permits.services import RequestWithdrawn, decide, withdraw

    p = permit(reviewer=reviewer, status=PermitRequest.Status.IN_REVIEW)
    stale = PermitRequest.objects.get(pk=p.pk)  # read before the withdrawal, as a view would
    withdraw(p)
    with pytest.raises(RequestWithdrawn):
        decide(stale, reviewer, decision="approve")
    p.refresh_from_db()
    assert p.status == PermitRequest.Status.WITHDRAWN
    assert not ReviewDecision.objects.exists()


# --- rebuild report ---------------------------------------------------------------------


def test_rebuild__asks_to_confirm_and_says_what_happens_to_decisions(reviewer):
    p = permit(reviewer=reviewer)
    finished_report(p)
    client = client_for(reviewer)
    _decide(client, p, decision="approve")
    detail = client.get(f"/requests/{p.pk}/").content.decode()
    # Decided: a rebuild cannot change the outcome, so it is not offered (issue 33).
    assert "Rebuild report" not in detail and 'id="no-rebuild"' in detail
    assert "This request is decided" in detail
    refused = client.get(f"/requests/{p.pk}/revisions/", follow=True).content.decode()
    assert "This request is decided" in refused and "Rebuild the report of" not in refused
    client.post(f"/requests/{p.pk}/revisions/", {"seen_revision": 1})
    p.refresh_from_db()
    assert p.output_revision == 1
    # The office puts it back into review: the decision on revision 1 is still in force.
    PermitRequest.objects.filter(pk=p.pk).update(status=PermitRequest.Status.IN_REVIEW)
    detail = client.get(f"/requests/{p.pk}/").content.decode()
    assert "Rebuild report" in detail and "Request a new revision" not in detail
    page = client.get(f"/requests/{p.pk}/revisions/").content.decode()
    assert "Rebuild the report of" in page and "as <strong>revision 2</strong>" in page
    assert "the ones on revision 1 stay in the history" in page
    assert "Approve" in page and "rev-a" in page  # the open decision is named
    p.refresh_from_db()
    assert p.output_revision == 1  # looking at the question changed nothing
    client.post(f"/requests/{p.pk}/revisions/", {"seen_revision": 1})
    p.refresh_from_db()
    assert p.output_revision == 2
    detail = client.get(f"/requests/{p.pk}/").content.decode()
    assert 'id="decision-form"' in detail  # revision 2 starts without a decision
    assert "Your decision on revision 2" in detail


def test_rebuild__not_offered_before_the_first_report(reviewer):
    p = permit(reviewer=reviewer)
    page = client_for(reviewer).get(f"/requests/{p.pk}/").content.decode()
    assert "Generate report for revision 1" in page
    assert "Rebuild report" not in page


# --- friendly errors ------------------------------------------------------------------


def test_404__stale_link_shows_the_site_page_also_with_debug_on(reviewer, other_reviewer, settings):
    settings.DEBUG = True
    theirs = permit(reviewer=other_reviewer)
    client = client_for(reviewer)
    for url in (f"/requests/{theirs.pk}/", f"/requests/{theirs.pk}/report/", "/requests/99999/"):
        response = client.get(url)
        assert response.status_code == 404, url
        page = response.content.decode()
        assert "Back to my queue" in page and "permits.css" in page, url
        assert "URLconf" not in page and "DEBUG" not in page, url


def test_500__page_renders_without_a_request_context():
    from django.template import loader

    page = loader.get_template("500.html").render({})
    assert "Sorry, something went wrong" in page and "permits.css" in page


def test_csrf__posts_without_token_are_rejected(reviewer):
    p = permit(reviewer=reviewer)
    finished_report(p)
    notice = Notice.objects.get()
    client = client_for(reviewer, enforce_csrf_checks=True)
    for url, data in (
        (f"/requests/{p.pk}/revisions/", {"seen_revision": 1}),
        (f"/requests/{p.pk}/report/generate/", {}),
        (f"/requests/{p.pk}/decisions/", {"decision": "approve", "revision": 1}),
        (f"/notices/{notice.pk}/read/", {}),
        ("/notices/read-all/", {}),
        (reverse("logout"), {}),
    ):
        assert client.post(url, data).status_code == 403, url
    p.refresh_from_db()
    assert p.output_revision == 1
    assert not ReviewDecision.objects.exists()
    notice.refresh_from_db()
    assert notice.read_at is None


# --- notices -------------------------------------------------------------------------


def test_notices__inbox_lists_my_notices_with_unread_count(reviewer, other_reviewer):
    mine = permit(reviewer=reviewer)
    finished_report(mine)
    finished_report(permit(reviewer=other_reviewer))
    page = client_for(reviewer).get("/notices/").content.decode()
    assert page.count('class="inbox__item') == 1
    assert f"Report ready: {mine.reference} revision 1" in page
    assert "1 unread" in page


def test_notices__another_users_notice_answers_404(reviewer, other_reviewer):
    finished_report(permit(reviewer=other_reviewer))
    theirs = Notice.objects.get(recipient=other_reviewer)
    client = client_for(reviewer)
    assert client.get(f"/notices/{theirs.pk}/").status_code == 404
    assert client.post(f"/notices/{theirs.pk}/read/").status_code == 404
    client.post("/notices/read-all/")
    theirs.refresh_from_db()
    assert theirs.read_at is None


def test_notices__open_marks_read_and_goes_to_the_request(reviewer):
    p = permit(reviewer=reviewer)
    finished_report(p)
    notice = Notice.objects.get()
    client = client_for(reviewer)
    assert client.get(f"/notices/{notice.pk}/")["Location"] == f"/requests/{p.pk}/"
    notice.refresh_from_db()
    assert notice.read_at is None  # following the link by GET changes nothing
    response = client.post(f"/notices/{notice.pk}/read/", {"open": "1"})
    assert response["Location"] == f"/requests/{p.pk}/"
    notice.refresh_from_db()
    assert notice.read_at is not None
    assert "0 unread" in client.get("/notices/").content.decode()


def test_notices__of_a_revoked_request_say_so_and_link_nowhere(reviewer):
    p = permit(reviewer=reviewer)
    finished_report(p)
    notice = Notice.objects.get()
    revoke_reviewer(p, reviewer)
    client = client_for(reviewer)
    assert client.get(f"/requests/{p.pk}/").status_code == 404
    # The notice no longer leads there: it says so and opens the inbox (issue 33).
    notice.refresh_from_db()
    assert (notice.title, notice.link) == (f"No longer assigned: {p.reference}", "")
    followed = client.get(f"/notices/{notice.pk}/", follow=True)
    assert followed.status_code == 200 and followed.redirect_chain[-1][0] == "/notices/"
    inbox = followed.content.decode()
    assert f"No longer assigned: {p.reference}" in inbox
    assert f"/requests/{p.pk}/" not in inbox


def test_notices__mark_all_read(reviewer):
    finished_report(permit(reviewer=reviewer))
    finished_report(permit(reviewer=reviewer))
    client = client_for(reviewer)
    response = client.post("/notices/read-all/", follow=True)
    assert "Marked 2 notices read." in response.content.decode()
    assert not Notice.objects.filter(read_at__isnull=True).exists()


def test_detail__shows_the_delivery_state_of_each_of_my_notices(client, settings):
    from jobs.delivery.runner import run_delivery
    from jobs.models import Effect
    from permits.services import report_request
    from tests.permits import factories

    reviewer = get_user_model().objects.create_user("deliveries-reviewer", password="x")
    permit = factories.permit(reviewer=reviewer)
    job, _ = report_request(permit)
    settings.NOTICE_PROVIDER_URL = "http://127.0.0.1:9"  # nothing listens: transport error
    run_delivery(job.pk)
    states = dict(Effect.objects.filter(job=job).values_list("provider", "state"))
    assert states == {"inapp": "applied", "webhook": "pending"}
    client.force_login(reviewer)
    body = client.get(f"/requests/{permit.pk}/").content.decode()
    assert 'data-notice-state="applied"' in body and "Inbox" in body
    assert 'data-notice-state="pending"' in body and "Device" in body
    assert "webhook" not in body.lower()


def test_state_words__the_same_on_the_reviewer_page_and_in_the_admin(client, settings):
    """One table (jobs.words): the reviewer's badge word is the admin's tag word, the admin
    adds the engine's name; a provider's words are the site's on both sides."""
    from jobs.delivery.runner import run_delivery
    from jobs.models import EFFECT_STATES, JOB_STATES, Effect, Job
    from jobs.ops.words import EFFECT_STATE_WORDS, JOB_STATE_WORDS
    from permits.services import report_request
    from tests.permits import factories

    assert list(JOB_STATE_WORDS) == JOB_STATES and list(EFFECT_STATE_WORDS) == EFFECT_STATES
    reviewer = get_user_model().objects.create_user("words-reviewer", password="x")
    operator = get_user_model().objects.create_superuser("words-operator", password="x")
    permit = factories.permit(reviewer=reviewer)
    job, _ = report_request(permit)
    settings.NOTICE_PROVIDER_URL = "http://127.0.0.1:9"  # the webhook notice keeps retrying
    run_delivery(job.pk)
    Effect.objects.filter(job=job, provider="webhook").update(state=Effect.State.SENDING)

    client.force_login(reviewer)
    body = client.get(f"/requests/{permit.pk}/").content.decode()
    assert 'Device <span class="badge badge--running">being sent</span>' in body
    assert "Sending" not in body
    Job.objects.filter(pk=job.pk).update(state=Job.State.DEAD)  # as the admin shows below
    body = client.get(f"/requests/{permit.pk}/").content.decode()
    assert re.search(r'badge--failed badge--large" [^>]*data-state="dead">Stopped<', body)
    assert ">Dead<" not in body

    client.force_login(operator)
    page = client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert re.search(r'jobs-tone--failed">Stopped <span class="jobs-state__engine">· dead<', page)
    listing = client.get("/admin/jobs/job/?state__exact=dead").content.decode()
    assert "Stopped · dead" in listing  # the filter, in the same words
    effects = client.get("/admin/jobs/effect/").content.decode()
    assert 'jobs-tone--running">Being sent <span class="jobs-state__engine">· sending<' in effects
    assert 'Device <span class="jobs-state__engine">· webhook<' in effects
    assert 'Inbox <span class="jobs-state__engine">· inapp<' in effects
