"""Who may see and who may grant (issue 20).

No contact oracle in the admin (lookups, ordering, search on applicant fields need the
contact permission), assignments as an audited duty nobody grants themselves, bounded
rebuilds per user, a per-address cap on failed logins, and safe download filenames.
"""

from __future__ import annotations

import logging
from urllib.parse import urlencode

import pytest
from axes.models import AccessAttempt
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.management import call_command
from django.test import Client, RequestFactory
from guardian.shortcuts import get_perms

from jobs.delivery.runner import run_delivery
from jobs.models import Effect, Job, Notice
from permits import selectors
from permits.models import (
    PRIVATE_FIELDS,
    ApplicantContactView,
    PermitRequest,
    ReportRebuild,
    ReviewerAssignment,
)
from permits.services import (
    SelfGrantRefused,
    acting,
    assign_reviewer,
    report_request,
    revoke_reviewer,
)
from permits.signals import OFFICE_ADMINS
from permits.views import content_disposition
from tests.permits import factories
from tests.permits.factories import PRIVATE

pytestmark = pytest.mark.django_db

PASSWORD = "correct-horse-battery-9"
CHANGELIST = "/admin/permits/permitrequest/"


def signed_in(user, **kwargs) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


def fresh(user):
    """The user again, without cached permissions."""
    return get_user_model().objects.get(pk=user.pk)


def finished_report(permit: PermitRequest) -> Job:
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "succeeded"
    job.refresh_from_db()
    return job


@pytest.fixture
def reviewer(make_user):
    user = make_user(username="acc-reviewer", password=PASSWORD)
    user.groups.add(Group.objects.get(name="reviewers"))
    factories.tenant().members.add(user)  # a reviewer of the factories' office
    return user


@pytest.fixture
def other_reviewer(make_user):
    user = make_user(username="acc-reviewer-2", password=PASSWORD)
    user.groups.add(Group.objects.get(name="reviewers"))
    factories.tenant().members.add(user)  # a reviewer of the factories' office
    return user


@pytest.fixture
def operator(make_user):
    user = make_user(username="acc-operator", password=PASSWORD, is_staff=True)
    # Also a reviewer: self-assignment would give it something to see.
    user.groups.add(Group.objects.get(name="operators"), Group.objects.get(name="reviewers"))
    return user


@pytest.fixture
def office_admin(make_user):
    user = make_user(username="acc-office", password=PASSWORD, is_staff=True)
    user.groups.add(Group.objects.get(name=OFFICE_ADMINS), Group.objects.get(name="reviewers"))
    factories.tenant().members.add(user)  # an office admin of the factories' office
    return user


# --- 1. no lookup, ordering or search on applicant fields without the permission ------------

SUFFIXES = [
    "",
    "__exact",
    "__iexact",
    "__startswith",
    "__istartswith",
    "__endswith",
    "__contains",
    "__icontains",
    "__regex",
    "__iregex",
    "__gte",
    "__in",
    "__isnull",
]


def matching_and_not(field: str, suffix: str) -> tuple[str, str]:
    value = PRIVATE[field]
    if suffix in ("__startswith", "__istartswith", "__contains", "__icontains", "__regex"):
        return value[:4], "~~no such value~~"
    if suffix == "__isnull":
        return "False", "True"
    if suffix == "__gte":
        return "", "~"
    return value, "~~no such value~~"


def test_changelist__every_applicant_lookup_is_refused_the_same_for_match_and_no_match(
    operator, reviewer, caplog
):
    assert not operator.has_perm("permits.view_applicant_contact")
    permit = factories.permit(reviewer=reviewer)
    client = signed_in(operator)
    assert client.get(CHANGELIST).status_code == 200
    checked = 0
    with caplog.at_level(logging.WARNING):
        for field in PRIVATE_FIELDS:
            for suffix in SUFFIXES:
                hit, miss = matching_and_not(field, suffix)
                answers = [
                    client.get(CHANGELIST + "?" + urlencode({field + suffix: value}))
                    for value in (hit, miss)
                ]
                assert [a.status_code for a in answers] == [400, 400], (field, suffix)
                assert answers[0].content == answers[1].content, (field, suffix)
                assert permit.reference.encode() not in answers[0].content
                checked += 1
    assert checked == len(PRIVATE_FIELDS) * len(SUFFIXES)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "admin lookup refused" in logged and "field=applicant_phone" in logged
    assert not any(PRIVATE[f] in logged or PRIVATE[f][:4] in logged for f in PRIVATE_FIELDS)
    assert not ApplicantContactView.objects.exists()


@pytest.mark.parametrize(
    "url",
    [
        # through relations, from the request's own changelist and from the others
        CHANGELIST + "?decisions__request__applicant_phone__startswith=%2B1",
        CHANGELIST + "?tenant__requests__applicant_email__contains=%40",
        "/admin/permits/reviewdecision/?request__applicant_phone__startswith=%2B1",
        # (operators may not open this list at all: 403 before any lookup)
        "/admin/permits/applicantcontactview/?request__applicant_name__startswith=Z",
        "/admin/permits/reviewerassignment/?request__applicant_id_number__startswith=X",
        "/admin/permits/tenant/?requests__applicant_phone__startswith=%2B1",
        # ordering by name (Django orders by column numbers; a name is refused all the same)
        CHANGELIST + "?o=applicant_phone",
        CHANGELIST + "?o=1.-applicant_name",
        CHANGELIST + "?o=tenant__requests__applicant_email",
    ],
)
def test_changelist__relations_and_ordering_to_applicant_fields_are_refused(operator, url):
    factories.permit()
    expected = 403 if "applicantcontactview" in url else 400
    assert signed_in(operator).get(url).status_code == expected, url


def test_changelist__search_never_reaches_applicant_fields(operator, reviewer):
    permit = factories.permit(reviewer=reviewer)
    client = signed_in(operator)
    for field in PRIVATE_FIELDS:
        hit = client.get(CHANGELIST, {"q": PRIVATE[field]})
        miss = client.get(CHANGELIST, {"q": "~~no such value~~"})
        assert hit.status_code == miss.status_code == 200
        assert hit.context["cl"].result_count == miss.context["cl"].result_count == 0
    model_admin = admin.site._registry[PermitRequest]
    request = RequestFactory().get(CHANGELIST)
    request.user = operator
    for name in model_admin.get_search_fields(request):
        assert name.lstrip("=^@") not in PRIVATE_FIELDS
    assert permit.reference in client.get(CHANGELIST, {"q": permit.reference}).content.decode()


def paths_to_private(model, depth: int = 3) -> list[str]:
    """Lookup paths (forward and reverse relations) from ``model`` to an applicant field."""
    found = []

    def walk(current, prefix: list[str], left: int) -> None:
        if issubclass(current, PermitRequest):
            found.append("__".join([*prefix, "applicant_phone"]))
        if left == 0:
            return
        for field in current._meta.get_fields():
            if field.is_relation and field.related_model is not None:
                walk(field.related_model, [*prefix, field.name], left - 1)

    walk(model, [], depth)
    return sorted(set(found))


def test_every_model_admin__refuses_lookups_reaching_applicant_fields(operator):
    request = RequestFactory().get("/admin/")
    request.user = operator
    checked = set()
    for model, model_admin in admin.site._registry.items():
        for path in paths_to_private(model):
            for lookup in (path, path + "__startswith"):
                assert not model_admin.lookup_allowed(lookup, "+1", request), (model, lookup)
            checked.add(model._meta.label_lower)
    assert {
        "permits.permitrequest",
        "permits.reviewdecision",
        "permits.applicantcontactview",
        "permits.reviewerassignment",
        "permits.tenant",
        "auth.user",
    } <= checked


@pytest.mark.parametrize(
    "url",
    [
        "/admin/jobs/job/?params__notify_user_id=1",
        "/admin/jobs/job/?params__icontains=zelda",
        "/admin/jobs/effect/?data__title__startswith=Report",
        "/admin/jobs/effect/?data__link__contains=requests",
    ],
)
def test_engine_admin__no_lookups_into_payloads(operator, url):
    client = signed_in(operator)
    assert client.get(url).status_code == 400, url
    assert client.get("/admin/jobs/job/?state__exact=queued").status_code == 200
    assert client.get("/admin/jobs/effect/?state__exact=applied").status_code == 200


def test_changelist__holder_may_filter_and_the_change_page_shows_and_records(operator, reviewer):
    operator.user_permissions.add(Permission.objects.get(codename="view_applicant_contact"))
    permit = factories.permit(reviewer=reviewer)
    other = factories.permit(reviewer=reviewer, applicant_phone="+44 20 7946 0000")
    client = signed_in(fresh(operator))
    found = client.get(CHANGELIST, {"applicant_phone__startswith": PRIVATE["applicant_phone"]})
    assert found.status_code == 200
    assert [p.pk for p in found.context["cl"].result_list] == [permit.pk]
    assert other.reference not in found.content.decode()
    html = client.get(f"{CHANGELIST}{permit.pk}/change/").content.decode()
    assert all(PRIVATE[f] in html for f in PRIVATE_FIELDS)
    assert ApplicantContactView.objects.filter(viewer=operator, request=permit).count() == 1


# --- 2. assignment is its own duty: audited, never to oneself ------------------------------


def guardian_attempts(client: Client, permit: PermitRequest, user) -> list[tuple[str, int]]:
    """Every screen and URL through which ``user`` could grant itself review on ``permit``."""
    base = f"{CHANGELIST}{permit.pk}"
    reviewers = Group.objects.get(name="reviewers")
    perms = {"permissions": ["review_permitrequest"]}
    tries = [
        ("GET", f"{base}/reviewers/", {}),
        ("POST", f"{base}/reviewers/", {"action": "assign", "reviewer": user.pk}),
        ("GET", f"{base}/permissions/", {}),
        ("POST", f"{base}/permissions/", {"user": user.username, "submit_manage_user": "1"}),
        ("GET", f"{base}/permissions/user-manage/{user.pk}/", {}),
        ("POST", f"{base}/permissions/user-manage/{user.pk}/", perms),
        ("POST", f"{base}/permissions/group-manage/{reviewers.pk}/", perms),
        ("POST", "/admin/guardian/userobjectpermission/add/", {}),
        ("POST", "/admin/guardian/groupobjectpermission/add/", {}),
        ("POST", f"/admin/auth/user/{user.pk}/change/", {"username": user.username}),
        ("POST", f"/admin/auth/group/{reviewers.pk}/change/", {"name": "reviewers"}),
    ]
    seen = []
    for method, url, data in tries:
        response = client.post(url, data) if method == "POST" else client.get(url)
        seen.append((f"{method} {url}", response.status_code))
    return seen


@pytest.mark.parametrize("who", ["operator", "office_admin"])
def test_self_grant__refused_through_every_screen(request, who, reviewer):
    user = request.getfixturevalue(who)
    permit = factories.permit(reviewer=reviewer)
    client = signed_in(user)
    for attempt, status in guardian_attempts(client, permit, user):
        if attempt.startswith("GET") and attempt.endswith("/reviewers/") and who != "operator":
            assert status == 200, attempt  # the office admin's own page, without itself in it
        else:
            assert status in (403, 404), (attempt, status)
    user = fresh(user)
    assert "review_permitrequest" not in get_perms(user, permit)
    assert signed_in(user).get(f"/requests/{permit.pk}/").status_code == 404
    assert not ReviewerAssignment.objects.filter(reviewer=user).exists()
    # The office admin's page does not even offer itself.
    if who == "office_admin":
        page = client.get(f"{CHANGELIST}{permit.pk}/reviewers/")
        choices = page.context["form"].fields["reviewer"].queryset
        assert user not in choices and reviewer not in choices  # assigned already


def test_self_grant__refused_in_the_service_and_where_the_row_is_written(office_admin):
    permit = factories.permit()
    with pytest.raises(SelfGrantRefused):
        assign_reviewer(permit, office_admin, by=office_admin)
    from guardian.shortcuts import assign_perm

    with pytest.raises(SelfGrantRefused), acting(office_admin, "shell"):
        assign_perm("review_permitrequest", office_admin, permit)
    reviewers = Group.objects.get(name="reviewers")
    with pytest.raises(SelfGrantRefused), acting(office_admin, "shell"):
        assign_perm("review_permitrequest", reviewers, permit)  # its own group
    assert not ReviewerAssignment.objects.exists()


def test_guardian_screens__superusers_only_and_not_for_themselves(make_user, reviewer, operator):
    boss = make_user(username="acc-boss", is_staff=True, is_superuser=True)
    permit = factories.permit()
    base = f"{CHANGELIST}{permit.pk}/permissions"
    assert signed_in(operator).get(f"{base}/").status_code == 403
    client = signed_in(boss)
    assert client.get(f"{base}/").status_code == 200
    assert client.get(f"{base}/user-manage/{boss.pk}/").status_code == 403
    done = client.post(
        f"{base}/user-manage/{reviewer.pk}/", {"permissions": ["review_permitrequest"]}
    )
    assert done.status_code == 302
    record = ReviewerAssignment.objects.get(request=permit)
    assert (record.action, record.reviewer, record.actor, record.via) == (
        "granted",
        reviewer,
        boss,
        "object permissions screen",
    )
    # The change page links guardian's screen for superusers only.
    assert "permissionslink" in client.get(f"{CHANGELIST}{permit.pk}/change/").content.decode()
    page = signed_in(operator).get(f"{CHANGELIST}{permit.pk}/change/").content.decode()
    assert "permissionslink" not in page and "assign-reviewers" not in page


def test_office_admin__assigns_recorded_shown_reviewer_sees_then_revocation_withholds(
    office_admin, reviewer, other_reviewer, settings
):
    permit = factories.permit(reviewer=other_reviewer)
    desk = signed_in(office_admin)
    change = desk.get(f"{CHANGELIST}{permit.pk}/change/").content.decode()
    assert 'id="assign-reviewers"' in change
    assert PRIVATE["applicant_phone"] not in change  # assigning is not reading contacts
    url = f"{CHANGELIST}{permit.pk}/reviewers/"
    assert signed_in(reviewer).get(f"/requests/{permit.pk}/").status_code == 404

    assert desk.post(url, {"action": "assign", "reviewer": reviewer.pk}).status_code == 302
    record = ReviewerAssignment.objects.get(request=permit, reviewer=reviewer)
    assert (record.action, record.actor, record.permission, record.via) == (
        "granted",
        office_admin,
        "review_permitrequest",
        "assign page",
    )
    shown = desk.get(f"{CHANGELIST}{permit.pk}/change/").content.decode()
    assert "Assignments (grants and revocations, newest first)" in shown
    assert "acc-reviewer" in shown and "acc-office" in shown  # whom, and who
    assert "Granted" in shown and "assign page" in shown
    page = desk.get(url).content.decode()
    assert f'id="revoke-{reviewer.pk}"' in page and "acc-office" in page

    card = signed_in(reviewer).get(f"/requests/{permit.pk}/")
    assert card.status_code == 200 and PRIVATE["applicant_phone"] in card.content.decode()

    # Revoke asks first, naming the reviewer and what they lose; nothing is revoked yet.
    asked = desk.post(url, {"action": "revoke", "user": reviewer.pk})
    assert asked.status_code == 200
    text = asked.content.decode()
    assert 'id="confirm-revoke"' in text and "Yes, revoke acc-reviewer" in text
    assert "applicant contacts" in text and "report" in text
    assert selectors.is_assigned(fresh(reviewer), permit)

    # Revoked while the report is being made: the job finishes, its notice is withheld.
    # The revocation is a whole admin request inside the attempt; on a loaded machine it
    # has outlasted the suite's 2 s lease (the attempt then ended lease_lost), so this
    # attempt gets a production-sized lease: the test is about the withholding.
    settings.JOBS_LEASE_SECONDS = 60
    job, _ = report_request(permit)

    def revoke_before_release(stage, ctx):
        if stage == "before_publish":
            done = desk.post(url, {"action": "revoke", "user": reviewer.pk, "confirm": "on"})
            assert done.status_code == 302

    assert run_delivery(job.pk, on_stage=revoke_before_release).outcome == "succeeded"
    effects = {e.recipient: e for e in Effect.objects.filter(job=job)}
    assert effects[str(reviewer.pk)].state == Effect.State.WITHHELD
    assert effects[str(other_reviewer.pk)].state == Effect.State.APPLIED
    assert not Notice.objects.filter(recipient=reviewer).exists()
    assert signed_in(reviewer).get(f"/requests/{permit.pk}/").status_code == 404
    revoked = ReviewerAssignment.objects.get(request=permit, reviewer=reviewer, action="revoked")
    assert revoked.actor == office_admin
    assert "Revoked" in desk.get(f"{CHANGELIST}{permit.pk}/change/").content.decode()


def test_operator__cannot_assign_others_either(operator, reviewer):
    permit = factories.permit()
    url = f"{CHANGELIST}{permit.pk}/reviewers/"
    client = signed_in(operator)
    assert client.get(url).status_code == 403
    assert client.post(url, {"action": "assign", "reviewer": reviewer.pk}).status_code == 403
    assert not selectors.is_assigned(fresh(reviewer), permit)


def test_groups__office_admins_assign_operators_do_not():
    office = Group.objects.get(name=OFFICE_ADMINS)
    codes = set(office.permissions.values_list("codename", flat=True))
    assert "assign_reviewer" in codes and "view_applicant_contact" not in codes
    assert not codes & {"change_user", "change_group", "add_userobjectpermission"}
    operators = Group.objects.get(name="operators")
    assert not operators.permissions.filter(codename="assign_reviewer").exists()
    assert not operators.permissions.filter(content_type__app_label="guardian").exists()


def test_seed_demo__creates_an_office_admin_and_records_its_assignments():
    call_command("seed_demo", verbosity=0, stdout=open("/dev/null", "w"))  # noqa: SIM115
    records = ReviewerAssignment.objects.count()
    call_command("seed_demo", verbosity=0, stdout=open("/dev/null", "w"))  # noqa: SIM115
    assert ReviewerAssignment.objects.count() == records == 12  # one grant per request
    officeadmin = get_user_model().objects.get(username="officeadmin")
    assert officeadmin.has_perm("permits.assign_reviewer")
    assert not get_user_model().objects.get(username="operator").has_perm("permits.assign_reviewer")
    assert set(ReviewerAssignment.objects.values_list("via", flat=True)) == {"system"}


def test_revoke_reviewer__the_service_records_it(reviewer, office_admin):
    permit = factories.permit(reviewer=reviewer)
    assert revoke_reviewer(permit, reviewer, by=office_admin) is True
    assert revoke_reviewer(permit, reviewer, by=office_admin) is False  # nothing held: no row
    assert list(ReviewerAssignment.objects.values_list("action", flat=True)) == [
        "revoked",
        "granted",
    ]


# --- 3. bounded rebuilds per user -------------------------------------------------------------


def rebuild(client: Client, permit: PermitRequest, seen: int) -> str:
    response = client.post(
        f"/requests/{permit.pk}/revisions/", {"seen_revision": seen}, follow=True
    )
    assert response.status_code == 200
    return response.content.decode()


def test_rebuild__refused_while_the_current_report_is_being_prepared(reviewer):
    permit = factories.permit(reviewer=reviewer)
    finished_report(permit)
    client = signed_in(reviewer)
    assert "Rebuild started: the report is now revision 2" in rebuild(client, permit, 1)
    page = rebuild(client, permit, 2)  # revision 2's report is queued, not ready
    assert "The report of revision 2 is still being prepared" in page
    permit.refresh_from_db()
    assert permit.output_revision == 2
    job = selectors.report_job(permit)
    assert run_delivery(job.pk).outcome == "succeeded"
    assert "Rebuild started: the report is now revision 3" in rebuild(client, permit, 2)
    assert ReportRebuild.objects.filter(requested_by=reviewer).count() == 2


def test_rebuild__per_user_limit_with_a_clear_message(settings, reviewer, other_reviewer):
    settings.REBUILD_LIMIT = 2
    settings.REBUILD_LIMIT_WINDOW_MINUTES = 60
    permit = factories.permit(reviewer=reviewer)
    assign_reviewer(permit, other_reviewer)
    finished_report(permit)
    client = signed_in(reviewer)
    for seen in (1, 2):
        assert f"the report is now revision {seen + 1}" in rebuild(client, permit, seen)
        permit.refresh_from_db()
        finished_report(permit)
    page = rebuild(client, permit, 3)
    assert "You started 2 rebuilds in the last 60 minutes, the most allowed" in page
    assert "You can start another after" in page
    permit.refresh_from_db()
    assert permit.output_revision == 3
    # Per user: another reviewer still may.
    assert "the report is now revision 4" in rebuild(signed_in(other_reviewer), permit, 3)


# --- 4. login limits: a cap per address across usernames (password spraying) ----------------


def test_login__spraying_from_one_address_is_capped_and_an_office_admin_unlocks(
    settings, make_user, office_admin
):
    settings.LOGIN_ADDRESS_FAILURE_LIMIT = 8
    assert settings.AXES_FAILURE_LIMIT == 5
    make_user(username="victim", password=PASSWORD)
    here = Client(REMOTE_ADDR="203.0.113.50")
    statuses = [
        here.post("/accounts/login/", {"username": f"guess{i}", "password": "Winter2026!"})
        for i in range(8)
    ]
    assert [s.status_code for s in statuses] == [200] * 7 + [429]
    locked = here.post("/accounts/login/", {"username": "victim", "password": PASSWORD})
    assert locked.status_code == 429, "one address, many usernames: every login is refused"
    assert "too many failed logins from this address" in locked.content.decode()
    # Another address is not affected; per-username locks are unchanged (5 each).
    elsewhere = Client(REMOTE_ADDR="198.51.100.50")
    assert elsewhere.post("/accounts/login/", {"username": "victim", "password": PASSWORD})[
        "Location"
    ] == ("/")

    # The office admin unlocks the address in the admin (deletes its attempts).
    desk = signed_in(office_admin)
    rows = AccessAttempt.objects.filter(ip_address="203.0.113.50")
    assert desk.get("/admin/axes/accessattempt/").status_code == 200
    done = desk.post(
        "/admin/axes/accessattempt/",
        {
            "action": "delete_selected",
            "_selected_action": list(rows.values_list("pk", flat=True)),
            "post": "yes",
        },
    )
    assert done.status_code == 302 and not rows.exists()
    again = here.post("/accounts/login/", {"username": "victim", "password": PASSWORD})
    assert again.status_code == 302


def test_login__below_the_address_cap_other_users_at_that_address_log_in(settings, make_user):
    settings.LOGIN_ADDRESS_FAILURE_LIMIT = 20
    make_user(username="colleague", password=PASSWORD)
    here = Client(REMOTE_ADDR="203.0.113.51")
    for i in range(6):
        here.post("/accounts/login/", {"username": f"guess{i}", "password": "nope"})
    ok = here.post("/accounts/login/", {"username": "colleague", "password": PASSWORD})
    assert ok.status_code == 302


# --- 5. download filenames --------------------------------------------------------------------


def test_content_disposition__ascii_fallback_and_rfc6266_filename_star():
    header = content_disposition('SPR "7"/é\r\n-r1.pdf')
    assert header == (
        'attachment; filename="SPR_7_-r1.pdf"; '
        "filename*=UTF-8''SPR%20%227%22%2F%C3%A9%0D%0A-r1.pdf"
    )
    assert content_disposition("ééé") == (
        "attachment; filename=\"report.pdf\"; filename*=UTF-8''%C3%A9%C3%A9%C3%A9"
    )


def test_download__odd_reference_gets_a_safe_filename(reviewer):
    permit = factories.permit(reviewer=reviewer, reference='Bé "x"/1')
    finished_report(permit)
    response = signed_in(reviewer).get(f"/requests/{permit.pk}/report/?download=1")
    assert response.status_code == 200
    disposition = response["Content-Disposition"]
    assert disposition.startswith('attachment; filename="B_x_1-r1.pdf"; ')
    assert disposition.endswith("filename*=UTF-8''B%C3%A9%20%22x%22%2F1-r1.pdf")
