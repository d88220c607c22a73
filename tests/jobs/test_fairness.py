"""Weighted fair share across tenants in the next-job claim (docs/app/fairness.md).

PostgreSQL, real threads: ``WORKERS`` threads, each its own connection, claim the queue's
next job (``jobs.claiming.claims().claim_next``, a cluster's dequeue) and finish it at
once, as hosts x workers claiming one queue do. The claims are numbered in the order
they committed; a job's position is how many claims of other jobs came between its
request and its claim. The bound under test is ``K = 2 x hosts x workers``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from django.db import connection, connections
from django.db.models import F
from django.db.models.functions import Now

import jobs
from jobs import flow
from jobs.models import Job, TenantShare
from jobs.registry import kinds, register_kind
from tests.jobs.helpers import claim_next

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

KIND = "test.fairness"
HOSTS, WORKERS_PER_HOST = 2, 2
WORKERS = HOSTS * WORKERS_PER_HOST
K = 2 * HOSTS * WORKERS_PER_HOST


def _noop(ctx) -> list:
    return []


if KIND not in kinds():
    register_kind(KIND, _noop)


def flood(tenant: str, count: int) -> None:
    jobs.request_many(
        [
            {"kind": KIND, "subject": ("fair", f"{tenant}-{i}"), "tenant": tenant}
            for i in range(count)
        ]
    )


def _finish(job_id: int) -> None:
    """The claimed job's work, done at once: its slot (the tenant's bound) is free again."""
    Job.objects.filter(pk=job_id).update(
        state=Job.State.SUCCEEDED, version=F("version") + 1, finished_at=Now()
    )


class Claimers:
    """``WORKERS`` threads claiming ``queue`` until ``stop`` or nothing is due."""

    def __init__(self, *, limit: int, hold: float = 0.0) -> None:
        self.order: list[tuple[int, str]] = []  # (job id, tenant) in claim order
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.limit, self.hold = limit, hold
        self.empty_looks = 0
        self.holding = self.most_held = 0  # jobs claimed and not yet finished, at once

    def _run(self, name: str) -> None:
        try:
            while not self.stop.is_set():
                claim = claim_next("default", name)
                if claim is None:
                    with self.lock:
                        self.empty_looks += 1
                    if self.empty_looks > 50:
                        return
                    time.sleep(0.005)
                    continue
                if not claim.won:
                    continue
                with self.lock:
                    self.order.append((claim.job.pk, claim.job.tenant_key))
                    self.holding += 1
                    self.most_held = max(self.most_held, self.holding)
                    if len(self.order) >= self.limit:
                        self.stop.set()
                if self.hold:
                    time.sleep(self.hold)
                with self.lock:
                    self.holding -= 1
                _finish(claim.job.pk)
        finally:
            connections["default"].close()

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._run, args=(f"w{i}",)) for i in range(WORKERS)]
        for t in threads:
            t.start()
        return threads

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.order) < count and time.monotonic() < deadline and not self.stop.is_set():
            time.sleep(0.001)

    @staticmethod
    def join(threads: list[threading.Thread]) -> None:
        for t in threads:
            t.join(120)


def _flood_then_two(settings, *, fair: bool) -> dict[str, int | None]:
    """Tenant a floods 1,000 jobs; after 20 claims b and c ask for one each: how many
    claims came between each request and its claim (None: not within 3K + 40)."""
    settings.JOBS_FAIR_SHARE = fair
    settings.JOBS_TENANT_CONCURRENCY = WORKERS  # the cap never binds: a alone fills it
    flood("a", 1000)
    claimers = Claimers(limit=20 + 3 * K + 40)
    threads = claimers.start()
    claimers.wait_for(20)
    asked = {}
    for tenant in ("b", "c"):
        flood(tenant, 1)
        asked[tenant] = len(claimers.order)  # claims committed before it cannot see it
    Claimers.join(threads)
    seen: dict[str, int | None] = {}
    for tenant in ("b", "c"):
        at = next((i for i, (_, t) in enumerate(claimers.order) if t == tenant), None)
        seen[tenant] = None if at is None else at - asked[tenant]
    return seen


def test_flood__cap_only_claim_keeps_b_and_c_behind_the_flood(settings):
    """Today's claim (due order; the tenant cap free): b and c wait behind a's 1,000."""
    seen = _flood_then_two(settings, fair=False)
    assert all(p is None or p > K for p in seen.values()), (K, seen)


def test_flood__fair_claim_takes_b_and_c_within_k_claims(settings):
    seen = _flood_then_two(settings, fair=True)
    print(f"K={K} positions={seen}")
    assert all(p is not None and p <= K for p in seen.values()), (K, seen)


def test_weights__3_to_1_both_flooding__shares_over_400_claims(settings):
    settings.JOBS_TENANT_CONCURRENCY = WORKERS
    flow.set_rule("tenant:a", actor="test", weight=3)
    flood("a", 500)
    flood("b", 500)
    claimers = Claimers(limit=400)
    Claimers.join(claimers.start())
    shares = Counter(t for _, t in claimers.order[:400])
    ratio = shares["a"] / shares["b"]
    print(f"shares={dict(shares)} ratio={ratio:.2f}")
    assert 2.7 <= ratio <= 3.3, shares


def test_weights__the_default_weight_is_a_live_rule(settings):
    """``tenant:*`` sets the weight of every tenant without its own: b (default 3) gets
    three claims for each of a's (its own rule, 1)."""
    settings.JOBS_TENANT_CONCURRENCY = WORKERS
    flow.set_rule("tenant:*", actor="test", weight=3)
    flow.set_rule("tenant:a", actor="test", weight=1)
    flood("a", 250)
    flood("b", 500)
    claimers = Claimers(limit=400)
    Claimers.join(claimers.start())
    shares = Counter(t for _, t in claimers.order[:400])
    assert 2.7 <= shares["b"] / shares["a"] <= 3.3, shares


def test_alone__a_tenant_alone_gets_every_slot(settings):
    """Work-conserving: alone, a tenant's claims fill every worker: all 200 claimed, and
    at some point each of the ``WORKERS`` claimers held one of its jobs (its bound is the
    cluster's size). Its throughput against the claim without the fair order is measured
    by ``make bench`` (section fairshare) and the fairness drill, not asserted here."""
    settings.JOBS_FAIR_SHARE = True
    settings.JOBS_TENANT_CONCURRENCY = WORKERS
    flood("a", 200)
    claimers = Claimers(limit=200, hold=0.05)
    Claimers.join(claimers.start())
    assert len(claimers.order) == 200, claimers.order
    assert claimers.most_held == WORKERS, claimers.most_held


def pick_query(queue: str = "default", *, aging: float = 60.0, bound: int = 4) -> str:
    """``jobs_fair_pick_v1``'s query as a statement of its own (for ``EXPLAIN``)."""
    from jobs import fairness

    text = fairness._picking_query().replace("SELECT p.id INTO v_id FROM", "SELECT p.id FROM")
    for name, value in (
        ("p_queue", f"'{queue}'"),
        ("p_now", "clock_timestamp()"),
        ("p_aging", f"{aging}::float8"),
        ("p_bound", str(bound)),
    ):
        text = text.replace(name, value)
    return text.rstrip(";")


def test_claim__reads_each_waiting_tenant_once_not_its_backlog(settings):
    """The fair pick walks the tenants by the index (one probe each) and reads a tenant's
    head, never a flood of 1,000 rows, nor the 3,000 finished jobs beside them."""
    from tests.jobs.helpers import scans_of

    flood("history", 3000)
    Job.objects.update(state=Job.State.SUCCEEDED)  # a tenant's past is in the table too
    flood("a", 1000)
    flood("b", 1)
    flood("c", 1)
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE jobs_job")
    scans = scans_of(pick_query(), [])
    assert scans and max(rows for _, _, rows in scans) <= 5, scans
    assert sum(rows for _, _, rows in scans) <= 30, scans
    assert {index for _, index, _ in scans} <= {
        "jobs_job_claim_tenant_idx",
        "jobs_job_claim_wait_idx",
        "jobs_job_tenant_state_idx",  # a tenant's live running jobs, for its bound
    }, scans


@pytest.mark.parametrize("others", [0, 2])
def test_claim__the_probe_for_a_second_tenant_reads_no_backlog(settings, others):
    """The fair claim's probe (``fairness.contended_sql``): two ordered probes of the
    tenants' index, whether the flood is alone or not, never the flood nor the history;
    alone, the fair pick never runs."""
    from jobs import fairness

    settings.JOBS_FAIR_SHARE = True
    flood("history", 3000)
    Job.objects.update(state=Job.State.SUCCEEDED)
    flood("a", 1000)
    for tenant in "bc"[:others]:
        flood(tenant, 1)
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE jobs_job")
    probe = "WITH " + fairness.contended_sql() + " SELECT many FROM contended"
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + probe, ["default"] * 2)
        [[plan]] = cursor.fetchone()
    scans = _scans(plan["Plan"])
    assert {index for index, _ in scans} == {"jobs_job_claim_tenant_idx"}, scans
    assert sum(read for _, read in scans) <= 4, scans
    # Alone, the charge is not called (its first claim without a row charges it, as a
    # lagging tenant's do: the contract test).
    TenantShare.objects.create(queue="default", tenant_key="a", start=0.0, finish=1.0)
    assert _calls_of_one_claim() == ((1, 1) if others else (0, 0))


def _scans(plan: dict) -> list[tuple[str, int]]:
    """(index, rows read: produced and filtered out) of each job-table scan of a plan."""
    found = []
    if plan.get("Relation Name") == "jobs_job":
        read = plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
        found.append((plan.get("Index Name", plan["Node Type"]), read))
    for child in plan.get("Plans", []):
        found += _scans(child)
    return found


def _calls_of_one_claim() -> tuple[int, int]:
    """How often one next-job claim statement called the fair pick and the charge (the
    server's per-transaction function counts), its writes rolled back."""
    from jobs import fairness
    from jobs.executors import pgclaim

    sql, params = pgclaim.next_statement("default", "w-probe", lease=30.0, bound=4)
    names = (fairness.PICK_FUNCTION, fairness.CHARGE_FUNCTION)
    with connection.cursor() as cursor:
        cursor.execute("BEGIN")
        cursor.execute("SET LOCAL track_functions = 'pl'")
        cursor.execute(sql, params)
        assert cursor.fetchone()[-4] is not None  # a job was picked
        cursor.execute(
            "SELECT "
            + ", ".join("COALESCE(pg_stat_get_xact_function_calls(%s::regproc), 0)" for _ in names),
            list(names),
        )
        calls = tuple(cursor.fetchone())
        cursor.execute("ROLLBACK")
    return calls


# --- weights as flow rules: jobs_limits, the admin form, the checks -----------------------


def test_jobs_limits__set_weight__live_audited_and_shown():
    from io import StringIO

    from django.core.management import call_command

    from jobs.models import FlowRule, FlowRuleChange

    out = StringIO()
    call_command("jobs_limits", "set", "tenant:acme", "--weight", "3", "--actor", "ops", stdout=out)
    assert "weight 3" in out.getvalue()
    assert FlowRule.objects.get(scope="tenant:acme").weight == 3
    change = FlowRuleChange.objects.get(scope="tenant:acme")
    assert (change.action, change.actor, change.after) == ("set", "ops", "weight 3")
    call_command("jobs_limits", "set", "tenant:*", "--weight", "2", stdout=StringIO())
    shown = StringIO()
    call_command("jobs_limits", "show", stdout=shown)
    lines = {line.split()[0]: line for line in shown.getvalue().splitlines()}
    assert " 3 " in lines["tenant:acme"] and " 2 " in lines["tenant:*"]
    call_command("jobs_limits", "set", "tenant:acme", "--weight", "default", stdout=StringIO())
    assert FlowRule.objects.get(scope="tenant:acme").weight is None


@pytest.mark.parametrize(
    ("scope", "changes", "words"),
    [
        ("kind:billing", {"weight": 2}, "a weight is a tenant's"),
        ("tenant:acme", {"weight": 0}, "from 1 to"),
        ("tenant:acme", {"weight": "many"}, "whole number"),
        ("tenant:*", {"concurrency": 2}, "only the default weight"),
    ],
)
def test_set_rule__a_weight_outside_its_scope_or_bounds_is_refused(scope, changes, words):
    with pytest.raises(flow.FlowError, match=words):
        flow.set_rule(scope, actor="test", **changes)


def test_admin_form__edits_a_weight_with_the_same_checks():
    from jobs.ops.admin_flow import FlowRuleForm

    ok = FlowRuleForm(data={"scope": "tenant:acme", "weight": 3, "period_seconds": 1.0})
    assert ok.is_valid(), ok.errors
    refused = FlowRuleForm(data={"scope": "kind:billing", "weight": 3, "period_seconds": 1.0})
    assert not refused.is_valid()
    assert "a weight is a tenant's" in refused.errors["__all__"][0]


def test_set_rule__no_weight_on_another_scope_is_no_change(settings):
    """The admin's form always sends the weight field: empty on a kind's rule is fine."""
    rule = flow.set_rule("kind:billing", actor="test", concurrency=2, weight=None)
    assert (rule.concurrency, rule.weight) == (2, None)


def test_functions__frozen_text_is_what_the_fair_order_generates():
    import importlib

    from jobs import fairness

    first = importlib.import_module("jobs.migrations.0030_fair_share_functions")
    pick = importlib.import_module("jobs.migrations.0035_fair_pick_v2")
    message = "jobs.fairness changed: add a migration with jobs_fair_pick_v3 / _charge_v2"
    assert fairness.pick_function_sql() == "\n" + pick.PICK, message
    assert fairness.charge_function_sql() == "\n" + first.CHARGE, message


def test_fair_claim__its_statement_stays_in_psycopgs_parse_cache():
    """Over 4 KiB psycopg parses the statement again on every claim (its cache's limit):
    that cost a sixth of the no-tenant claim's throughput when it was 4,292 characters."""
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

    from jobs.executors import pgclaim

    assert len(pgclaim._fair_statement()) <= MAX_CACHED_STATEMENT_LENGTH
    assert len(pgclaim._next_statement()) <= MAX_CACHED_STATEMENT_LENGTH
