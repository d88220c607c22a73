"""The fair share on whichever database the suite runs on (SQLite's leg: the ORM claim).

Sequential claims of the queue's next job (``jobs.claiming.claims().claim_next``); the
threaded bounds are PostgreSQL's (``tests/jobs/test_fairness.py``)."""

from __future__ import annotations

import pytest
from django.db.models import F

import jobs
from jobs import flow
from jobs.models import Job, TenantShare
from jobs.registry import kinds, register_kind
from tests.jobs.helpers import claim_next

pytestmark = pytest.mark.django_db(transaction=True)

KIND = "test.fairness.any"

if KIND not in kinds():
    register_kind(KIND, lambda ctx: [])


def _ask(tenant: str, count: int) -> None:
    jobs.request_many(
        [
            {"kind": KIND, "subject": ("fair", f"{tenant}-{i}"), "tenant": tenant}
            for i in range(count)
        ]
    )


def _claims(n: int) -> list[str]:
    """``n`` claims, each job finished at once; the tenant of each."""
    order = []
    for _ in range(n):
        claim = claim_next("default", "w1")
        assert claim is not None and claim.won, claim
        order.append(claim.job.tenant_key)
        Job.objects.filter(pk=claim.job.pk).update(
            state=Job.State.SUCCEEDED, version=F("version") + 1
        )
    return order


def test_fair_share__a_late_tenant_goes_next_weights_share_the_rest(settings):
    settings.JOBS_TENANT_CONCURRENCY = 4
    flow.set_rule("tenant:a", actor="test", weight=2)
    _ask("a", 20)
    assert _claims(3) == ["a", "a", "a"]  # alone: every claim is its (work-conserving)
    _ask("b", 10)
    order = _claims(9)
    assert order[0] == "b", order  # the new tenant starts at the virtual time: next
    assert order.count("a") == 6 and order.count("b") == 3, order  # 2:1
    assert TenantShare.objects.get(tenant_key="b").claims == 3
