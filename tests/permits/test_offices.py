"""Offices bind office admins and reviewers (issue 33): every URL and POST, one table.

An office admin of office A can neither list, open, assign on, nor assign to, office B's
requests, by any route; a reviewer of B is not offered (nor accepted) for A's request;
a superuser can do all of it. The outside probe's step (``officeadmin`` assigns a
Springfield reviewer to a Shelbyville request) answers 404 and records nothing.
"""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management import call_command
from django.test import Client
from guardian.shortcuts import assign_perm

from jobs.models import Job
from permits import offices, selectors
from permits.models import PermitRequest, ReviewerAssignment
from permits.offices import OutsideOffice
from permits.services import acting, assign_reviewer
from permits.signals import OFFICE_ADMINS
from tests.permits import factories

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/permits/permitrequest/"


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def member(user, office):
    office.members.add(user)
    return user


@pytest.fixture
def office_a():
    return factories.tenant("springfield")


@pytest.fixture
def office_b():
    return factories.tenant("shelbyville")


@pytest.fixture
def admin_a(make_user, office_a):
    user = make_user(username="admin-a", is_staff=True)
    user.groups.add(Group.objects.get(name=OFFICE_ADMINS))
    return member(user, office_a)


@pytest.fixture
def reviewer_a(make_user, office_a):
    user = make_user(username="rev-a")
    user.groups.add(Group.objects.get(name="reviewers"))
    return member(user, office_a)


@pytest.fixture
def reviewer_b(make_user, office_b):
    user = make_user(username="rev-b")
    user.groups.add(Group.objects.get(name="reviewers"))
    return member(user, office_b)


@pytest.fixture
def superuser(make_user):
    return make_user(username="root-user", is_staff=True, is_superuser=True)


def _routes(permit: PermitRequest, reviewer, by) -> list[tuple[str, str, dict]]:
    """Every admin route that reads or writes one request, with the POST it takes."""
    base = f"{CHANGELIST}{permit.pk}"
    return [
        ("GET", f"{base}/change/", {}),
        ("POST", f"{base}/change/", {"status": "approved"}),
        ("GET", f"{base}/history/", {}),
        ("GET", f"{base}/delete/", {}),
        ("POST", f"{base}/delete/", {"post": "yes"}),
        ("GET", f"{base}/reviewers/", {}),
        ("POST", f"{base}/reviewers/", {"action": "assign", "reviewer": reviewer.pk}),
        ("POST", f"{base}/reviewers/", {"action": "revoke", "user": reviewer.pk}),
        ("POST", f"{base}/reviewers/", {"action": "revoke", "user": reviewer.pk, "confirm": "on"}),
        ("GET", f"{base}/permissions/", {}),
        ("POST", f"{base}/permissions/", {"user": reviewer.username, "submit_manage_user": "1"}),
        ("GET", f"{base}/permissions/user-manage/{reviewer.pk}/", {}),
        (
            "POST",
            f"{base}/permissions/user-manage/{reviewer.pk}/",
            {"permissions": ["review_permitrequest"]},
        ),
        ("GET", f"/requests/{permit.pk}/", {}),
        ("GET", f"/requests/{permit.pk}/report/", {}),
    ]


def test_office_admin__cannot_reach_another_offices_request_by_any_route(
    admin_a, reviewer_a, reviewer_b, office_b
):
    theirs = factories.permit(office_b, reviewer=reviewer_b)
    before = set(ReviewerAssignment.objects.values_list("pk", flat=True))
    desk = signed_in(admin_a)
    for reviewer in (reviewer_a, reviewer_b):
        for method, url, data in _routes(theirs, reviewer, admin_a):
            response = desk.get(url) if method == "GET" else desk.post(url, data)
            assert response.status_code in (403, 404), (method, url, data, response.status_code)
    # A bulk action on the changelist naming it: nothing happens to it.
    desk.post(
        CHANGELIST,
        {"action": "delete_selected", "_selected_action": [theirs.pk], "post": "yes"},
    )
    assert PermitRequest.objects.filter(pk=theirs.pk).exists()
    # Nothing was written: no grant, no revocation, no change.
    assert set(ReviewerAssignment.objects.values_list("pk", flat=True)) == before
    assert selectors.is_assigned(reviewer_b, theirs)
    assert not selectors.is_assigned(reviewer_a, theirs)
    theirs.refresh_from_db()
    assert theirs.status == PermitRequest.Status.SUBMITTED


def test_office_admin__lists_and_filters_only_their_offices_requests(
    admin_a, office_a, office_b, reviewer_b
):
    mine = factories.permit(office_a)
    theirs = factories.permit(office_b, reviewer=reviewer_b)
    desk = signed_in(admin_a)
    for query in ("", f"?tenant__id__exact={office_b.pk}", f"?q={theirs.reference}"):
        page = desk.get(CHANGELIST + query)
        assert page.status_code == 200, query
        assert f"{CHANGELIST}{theirs.pk}/change/" not in page.content.decode(), query
    listing = desk.get(CHANGELIST).content.decode()
    assert f"{CHANGELIST}{mine.pk}/change/" in listing
    assert office_b.name not in listing  # the office filter offers their offices only
    records = desk.get("/admin/permits/reviewerassignment/").content.decode()
    assert theirs.reference not in records  # the record of another office's grants too


def test_office_admin__offered_and_allowed_only_their_offices_reviewers(
    admin_a, office_a, reviewer_a, reviewer_b
):
    mine = factories.permit(office_a)
    url = f"{CHANGELIST}{mine.pk}/reviewers/"
    desk = signed_in(admin_a)
    page = desk.get(url).content.decode()
    assert f'value="{reviewer_a.pk}"' in page and "rev-a" in page
    assert f'value="{reviewer_b.pk}"' not in page and "rev-b" not in page
    refused = desk.post(url, {"action": "assign", "reviewer": reviewer_b.pk})
    assert refused.status_code == 403
    assert not ReviewerAssignment.objects.filter(request=mine).exists()
    assert not selectors.is_assigned(reviewer_b, mine)
    assert desk.post(url, {"action": "assign", "reviewer": reviewer_a.pk}).status_code == 302
    assert selectors.is_assigned(reviewer_a, mine)


def test_office_rule__holds_in_the_service_and_where_guardians_row_is_written(
    admin_a, office_a, reviewer_b
):
    mine = factories.permit(office_a)
    with pytest.raises(OutsideOffice):
        assign_reviewer(mine, reviewer_b, by=admin_a)
    with pytest.raises(OutsideOffice), acting(admin_a, "shell"):
        assign_perm("review_permitrequest", reviewer_b, mine)
    assert not ReviewerAssignment.objects.filter(request=mine).exists()


def test_superuser__stays_global(superuser, office_a, office_b, reviewer_a, reviewer_b):
    theirs = factories.permit(office_b)
    client = signed_in(superuser)
    assert client.get(f"{CHANGELIST}{theirs.pk}/change/").status_code == 200
    url = f"{CHANGELIST}{theirs.pk}/reviewers/"
    page = client.get(url).content.decode()
    assert "rev-a" in page and "rev-b" in page
    assert client.post(url, {"action": "assign", "reviewer": reviewer_a.pk}).status_code == 302
    assert selectors.is_assigned(reviewer_a, theirs)


def test_probe__officeadmin_assigning_a_springfield_reviewer_to_shelbyville_is_refused():
    call_command("seed_demo", verbosity=0, stdout=open("/dev/null", "w"))  # noqa: SIM115
    User = get_user_model()
    officeadmin, reviewer47 = (User.objects.get(username=n) for n in ("officeadmin", "reviewer47"))
    shelbyville = PermitRequest.objects.get(reference="SHE-2026-0012")
    records = ReviewerAssignment.objects.count()
    jobs_before = Job.objects.count()
    desk = signed_in(officeadmin)
    url = f"{CHANGELIST}{shelbyville.pk}/reviewers/"
    assert desk.get(url).status_code == 404
    done = desk.post(url, {"action": "assign", "reviewer": reviewer47.pk})
    assert done.status_code in (403, 404)
    assert ReviewerAssignment.objects.count() == records
    assert Job.objects.count() == jobs_before  # no notice asked for either
    assert not reviewer47.has_perm("permits.review_permitrequest", shelbyville)
    assert signed_in(reviewer47).get(f"/requests/{shelbyville.pk}/").status_code == 404
    # Their own office still works: officeadmin sees and assigns on Springfield's requests.
    springfield = PermitRequest.objects.get(reference="SPR-2026-0006")
    assert desk.get(f"{CHANGELIST}{springfield.pk}/reviewers/").status_code == 200


def test_seed_demo__gives_every_demo_person_their_offices():
    call_command("seed_demo", verbosity=0, stdout=open("/dev/null", "w"))  # noqa: SIM115
    keys = {
        u.username: sorted(u.offices.values_list("key", flat=True))
        for u in get_user_model().objects.filter(offices__isnull=False).distinct()
    }
    assert keys == {
        "officeadmin": ["springfield"],
        "reviewer47": ["springfield"],
        "reviewer52": ["shelbyville", "springfield"],
    }
    assert offices.unplaced_people() == []


def test_migration__gives_the_demo_people_their_offices(office_a, office_b, make_user):
    people = {n: make_user(username=n) for n in ("reviewer47", "reviewer52", "officeadmin")}
    migration = importlib.import_module("permits.migrations.0005_office_members")
    migration.demo_offices(apps, None)
    assert list(people["officeadmin"].offices.values_list("key", flat=True)) == ["springfield"]
    assert people["reviewer52"].offices.count() == 2


def test_check__names_office_admins_and_reviewers_without_an_office(make_user, office_a):
    lost = make_user(username="lost-reviewer")
    lost.groups.add(Group.objects.get(name="reviewers"))
    admin = make_user(username="lost-admin", is_staff=True)
    admin.groups.add(Group.objects.get(name=OFFICE_ADMINS))
    [warning] = offices.check_offices()
    assert warning.id == "permits.W001"
    assert "lost-admin" in warning.msg and "lost-reviewer" in warning.msg
    office_a.members.add(lost, admin)
    assert offices.check_offices() == []


def test_office_admin__without_an_office_sees_nothing(make_user, office_a):
    nowhere = make_user(username="admin-nowhere", is_staff=True)
    nowhere.groups.add(Group.objects.get(name=OFFICE_ADMINS))
    permit = factories.permit(office_a)
    desk = signed_in(nowhere)
    assert f"{CHANGELIST}{permit.pk}/change/" not in desk.get(CHANGELIST).content.decode()
    assert desk.get(f"{CHANGELIST}{permit.pk}/reviewers/").status_code == 404


def test_groups__office_admins_hold_no_model_wide_view_of_requests():
    codes = set(
        Group.objects.get(name=OFFICE_ADMINS).permissions.values_list("codename", flat=True)
    )
    assert "view_permitrequest" not in codes and "assign_reviewer" in codes
