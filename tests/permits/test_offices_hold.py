"""Offices that hold (issue 44): a request's office, its members and its decisions.

An operator cannot move a request to another office (the field is read-only and a forged
POST changes nothing); a superuser's move revokes the grants of people outside the new
office in the same transaction; leaving an office revokes the grants on its requests,
recorded as revocations; decisions are deleted by a superuser only and never edited.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group
from django.core.exceptions import PermissionDenied
from django.test import Client
from guardian.shortcuts import get_perms

from permits import services
from permits.models import PermitRequest, ReviewDecision, ReviewerAssignment
from tests.permits import factories
from tests.permits.test_admin import _change_form_data

pytestmark = pytest.mark.django_db


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def office_a():
    return factories.tenant("springfield")


@pytest.fixture
def office_b():
    return factories.tenant("shelbyville")


@pytest.fixture
def reviewer(make_user, office_a):
    user = make_user(username="rev-a", is_staff=True)
    user.groups.add(Group.objects.get(name="reviewers"))
    office_a.members.add(user)
    return user


@pytest.fixture
def operator(make_user):
    user = make_user(username="op", is_staff=True)
    user.groups.add(Group.objects.get(name="operators"))
    return user


@pytest.fixture
def boss(make_user):
    return make_user(username="boss", is_staff=True, is_superuser=True)


def change_url(permit) -> str:
    return f"/admin/permits/permitrequest/{permit.pk}/change/"


def test_office__operator_sees_the_office_read_only(operator, office_a, reviewer):
    permit = factories.permit(office_a, reviewer=reviewer)
    page = signed_in(operator).get(change_url(permit))
    assert page.status_code == 200
    assert 'name="tenant"' not in page.content.decode()
    assert "tenant" not in page.context["adminform"].form.fields


def test_office__operator_cannot_re_home_a_request_by_a_forged_post(
    operator, office_a, office_b, reviewer
):
    permit = factories.permit(office_a, reviewer=reviewer)
    client = signed_in(operator)
    data = _change_form_data(client.get(change_url(permit)))
    saved = client.post(change_url(permit), {**data, "tenant": str(office_b.pk)})
    assert saved.status_code == 302, saved.content.decode()[-1500:]
    permit.refresh_from_db()
    assert permit.tenant_id == office_a.pk, "the forged office was ignored"
    assert "review_permitrequest" in get_perms(reviewer, permit), "grants untouched"


def test_office__superuser_move_revokes_grants_outside_the_new_office(
    boss, office_a, office_b, reviewer, make_user
):
    both = make_user(username="rev-ab")
    both.groups.add(Group.objects.get(name="reviewers"))
    office_a.members.add(both)
    office_b.members.add(both)
    permit = factories.permit(office_a, reviewer=reviewer, status=PermitRequest.Status.IN_REVIEW)
    services.assign_reviewer(permit, both)
    revision = permit.output_revision
    client = signed_in(boss)
    data = _change_form_data(client.get(change_url(permit)))
    saved = client.post(change_url(permit), {**data, "tenant": str(office_b.pk)})
    assert saved.status_code == 302, saved.content.decode()[-1500:]
    permit.refresh_from_db()
    assert permit.tenant_id == office_b.pk
    assert get_perms(reviewer, permit) == [], "not of the new office: revoked"
    assert "review_permitrequest" in get_perms(both, permit), "of the new office: kept"
    record = ReviewerAssignment.objects.get(request=permit, reviewer=reviewer, action="revoked")
    assert record.actor == boss and record.via == "admin: office moved"
    # The old report's office key no longer passes its read policy: a new revision's does.
    assert permit.output_revision == revision + 1
    from permits import selectors

    assert selectors.report_job(permit).tenant_key == "shelbyville"


def test_office__move_request_is_refused_to_anyone_but_a_superuser(operator, office_a, office_b):
    permit = factories.permit(office_a)
    with pytest.raises(PermissionDenied):
        services.move_request(permit, office_b, by=operator)
    assert PermitRequest.objects.get(pk=permit.pk).tenant_id == office_a.pk


def test_office__member_removal_revokes_grants_on_its_requests(office_a, office_b, reviewer, boss):
    mine = factories.permit(office_a, reviewer=reviewer)
    office_b.members.add(reviewer)
    elsewhere = factories.permit(office_b, reviewer=reviewer)
    with services.acting(boss, "test"):
        office_a.members.remove(reviewer)
    assert get_perms(reviewer, mine) == []
    assert "review_permitrequest" in get_perms(reviewer, elsewhere), "the other office's stay"
    record = ReviewerAssignment.objects.get(request=mine, reviewer=reviewer, action="revoked")
    assert (record.actor, record.via, record.permission) == (boss, "test", "review_permitrequest")


def test_office__leaving_from_the_user_side_and_by_clear_revokes_too(office_a, reviewer):
    permit = factories.permit(office_a, reviewer=reviewer)
    reviewer.offices.remove(office_a)
    assert get_perms(reviewer, permit) == []
    office_a.members.add(reviewer)
    services.assign_reviewer(permit, reviewer)
    office_a.members.clear()
    assert get_perms(reviewer, permit) == []
    revoked = ReviewerAssignment.objects.filter(request=permit, action="revoked")
    assert revoked.count() == 2 and {r.via for r in revoked} == {"office members"}


def test_office__member_removed_in_the_admin_loses_the_request_pages(boss, office_a, reviewer):
    permit = factories.permit(office_a, reviewer=reviewer)
    reader = signed_in(reviewer)
    assert reader.get(f"/requests/{permit.pk}/").status_code == 200
    client = signed_in(boss)
    url = f"/admin/permits/tenant/{office_a.pk}/change/"
    data = _change_form_data(client.get(url))
    data["members"] = []
    saved = client.post(url, data)
    assert saved.status_code == 302, saved.content.decode()[-1500:]
    assert not office_a.members.filter(pk=reviewer.pk).exists()
    assert reader.get(f"/requests/{permit.pk}/").status_code == 404
    record = ReviewerAssignment.objects.get(request=permit, reviewer=reviewer, action="revoked")
    assert (record.actor, record.via) == (boss, "admin: office members")


def decision_on(permit, reviewer) -> ReviewDecision:
    made, _ = services.decide(permit, reviewer, decision="approve", comment="fine")
    return made


def test_decision__operator_cannot_delete_one_in_the_admin(operator, office_a, reviewer):
    permit = factories.permit(office_a, reviewer=reviewer)
    made = decision_on(permit, reviewer)
    client = signed_in(operator)
    url = f"/admin/permits/reviewdecision/{made.pk}/delete/"
    assert client.get(url).status_code == 403
    assert client.post(url, {"post": "yes"}).status_code == 403
    listing = client.post(
        "/admin/permits/reviewdecision/",
        {"action": "delete_selected", "_selected_action": [made.pk], "post": "yes"},
    )
    assert listing.status_code in (200, 302)
    assert ReviewDecision.objects.filter(pk=made.pk).exists()
    assert not operator.has_perm("permits.delete_reviewdecision")


def test_decision__operator_cannot_delete_it_by_deleting_its_request(operator, office_a, reviewer):
    permit = factories.permit(office_a, reviewer=reviewer)
    made = decision_on(permit, reviewer)
    url = f"/admin/permits/permitrequest/{permit.pk}/delete/"
    refused = signed_in(operator).post(url, {"post": "yes"})
    assert refused.status_code == 403
    assert ReviewDecision.objects.filter(pk=made.pk).exists()


def test_decision__superuser_deletes_one_and_it_is_logged(boss, office_a, reviewer, caplog):
    permit = factories.permit(office_a, reviewer=reviewer)
    made = decision_on(permit, reviewer)
    url = f"/admin/permits/reviewdecision/{made.pk}/delete/"
    with caplog.at_level("WARNING", logger="permits.decisions"):
        done = signed_in(boss).post(url, {"post": "yes"})
    assert done.status_code == 302
    assert not ReviewDecision.objects.filter(pk=made.pk).exists()
    assert f"decision deleted: decision={made.pk} request={permit.pk}" in caplog.text
    assert "fine" not in caplog.text, "the comment is not logged"


def test_decision__is_never_edited_in_place(office_a, reviewer):
    permit = factories.permit(office_a, reviewer=reviewer)
    made = decision_on(permit, reviewer)
    made.comment = "rewritten"
    with pytest.raises(PermissionDenied):
        made.save()
    assert ReviewDecision.objects.get(pk=made.pk).comment == "fine"
