"""The flow rules in the console, the admin and /metrics: shown, changed, audited."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry

from jobs import flow
from jobs.models import FlowRule, FlowRuleChange

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_rules():
    flow.forget()
    yield
    flow.forget()


def test_console__flow_section_lists_rules_and_defaults(client, admin_user):
    flow.set_rule("kind:test.steps", actor="test", concurrency=2, rate=3)
    client.force_login(admin_user)
    body = client.get("/admin/jobs/job/dashboard/").content.decode()
    assert 'id="flow-rules"' in body
    assert "kind:test.steps" in body and "rate 3/1s" in body and "at most 2 at once" in body
    assert "provider:webhook" in body, "an external provider shows its default bound"
    live = client.get("/admin/jobs/job/dashboard/?part=live").content.decode()
    assert 'id="flow-rules"' in live


def test_console__a_tenants_weight_is_shown_with_its_rule(client, admin_user):
    flow.set_rule("tenant:acme", actor="test", weight=3)
    client.force_login(admin_user)
    body = client.get("/admin/jobs/job/dashboard/").content.decode()
    assert "tenant:acme" in body and "weight 3 (its share of the claims)" in body


def test_admin__a_weight_is_edited_in_the_rule_form_and_audited(client, admin_user):
    client.force_login(admin_user)
    form = {"scope": "tenant:acme", "weight": "2", "period_seconds": "1.0"}
    answer = client.post("/admin/jobs/flowrule/add/", form)
    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert FlowRule.objects.get(scope="tenant:acme").weight == 2
    change = FlowRuleChange.objects.get(scope="tenant:acme")
    assert change.actor == f"operator:{admin_user.username}" and "weight 2" in change.after


def test_console__pause_and_resume_buttons__audited_with_the_operator(client, admin_user):
    client.force_login(admin_user)
    url = "/admin/jobs/flowrule/toggle/"
    assert client.get(url).status_code == 405
    asked = client.post(url, {"scope": "provider:webhook", "action": "pause"})
    assert asked.status_code == 200, "first a confirmation, inside the admin frame"
    page = asked.content.decode()
    assert "Pause provider:webhook?" in page and 'name="confirmed" value="yes"' in page
    assert not FlowRule.objects.filter(paused=True).exists(), "nothing changed yet"
    confirmed = {"scope": "provider:webhook", "action": "pause", "confirmed": "yes"}
    answer = client.post(url, confirmed)
    assert answer.status_code == 302 and answer["Location"].endswith("/admin/jobs/job/dashboard/")
    assert FlowRule.objects.get(scope="provider:webhook").paused
    done = client.post(url, {**confirmed, "action": "resume"}, follow=True).content.decode()
    assert not FlowRule.objects.get(scope="provider:webhook").paused
    assert "Resumed provider:webhook (the rule now: no limit (defaults))." in done, (
        "the message says what was done"
    )
    actors = list(FlowRuleChange.objects.order_by("id").values_list("action", "actor"))
    assert actors == [
        ("pause", f"operator:{admin_user.username}"),
        ("resume", f"operator:{admin_user.username}"),
    ]
    assert LogEntry.objects.filter(object_repr="provider:webhook").count() == 2


def test_console__toggle_needs_the_change_permission(client, make_user):
    viewer = make_user(is_staff=True)
    client.force_login(viewer)
    answer = client.post(
        "/admin/jobs/flowrule/toggle/", {"scope": "kind:x", "action": "pause", "confirmed": "yes"}
    )
    assert answer.status_code == 403
    page = answer.content.decode()
    assert 'id="site-name"' in page, "refused inside the admin frame, not a bare 403 page"
    assert "jobs.change_flowrule" in page and 'id="refused-back"' in page
    assert not FlowRule.objects.exists()


def test_admin__add_and_edit_go_through_the_audited_service(client, admin_user):
    client.force_login(admin_user)
    answer = client.post(
        "/admin/jobs/flowrule/add/",
        {"scope": "tenant:acme", "concurrency": "2", "rate": "5", "period_seconds": "1"},
    )
    assert answer.status_code == 302, answer.content.decode()[:2000]
    rule = FlowRule.objects.get(scope="tenant:acme")
    assert (rule.concurrency, rule.rate, rule.updated_by) == (
        2,
        5,
        f"operator:{admin_user.username}",
    )
    answer = client.post(
        f"/admin/jobs/flowrule/{rule.pk}/change/",
        {"concurrency": "", "rate": "5", "period_seconds": "60", "paused": "on"},
    )
    assert answer.status_code == 302
    rule.refresh_from_db()
    assert (rule.concurrency, rule.period_seconds, rule.paused) == (None, 60.0, True)
    changes = FlowRuleChange.objects.filter(scope="tenant:acme").order_by("id")
    assert [c.actor for c in changes] == [f"operator:{admin_user.username}"] * 2
    assert "paused" in changes.last().after
    bad = client.post("/admin/jobs/flowrule/add/", {"scope": "acme", "period_seconds": "1"})
    assert bad.status_code == 200 and "is not a scope" in bad.content.decode()


def test_metrics__per_scope_and_circuit(client, admin_user):
    flow.set_rule("provider:webhook", actor="test", rate=3)
    flow.pause("kind:test.steps", actor="test")
    client.force_login(admin_user)
    text = client.get("/metrics").content.decode()
    assert 'jobs_flow_paused{scope="kind:test.steps"} 1.0' in text
    assert 'jobs_flow_rate_per_second{scope="provider:webhook"} 3.0' in text
    assert 'jobs_flow_concurrency{scope="provider:webhook"}' in text
    assert 'jobs_provider_circuit{provider="webhook",state="closed"} 1.0' in text
    assert 'jobs_flow_waiting{scope="kind:test.steps"} 0.0' in text
