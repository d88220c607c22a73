"""The executor contract: every scenario on both executors, every row compared.

Publish: each scenario runs one delivery with the PostgreSQL executor and one with
the ORM executor (two jobs of the same kind with the same inputs), then compares
every row the deliveries wrote: the job, its attempts, the artifact, the effects,
their events and notices, and the queue messages. Claim: each scenario sets up the
same jobs and flow rules, claims them in the same order through one executor, and
records every row (jobs, attempts, which rules' starts were taken by each claim);
the two records must be equal and match what the scenario means. Ids, foreign keys
and timestamps are compared by meaning (the same reference, a timestamp set or not),
everything else by value.
"""

from __future__ import annotations

import re
import uuid

import pytest
from django.contrib.auth import get_user_model
from django.db import models
from django_q.models import OrmQ

from jobs import executors, rules
from jobs.delivery import policy, publish
from jobs.delivery.runner import JobContext, run_delivery
from jobs.engine import effect_machine, refusals
from jobs.executors import postgres
from jobs.models import (
    Artifact,
    Attempt,
    Effect,
    EffectEvent,
    FlowRule,
    Job,
    Notice,
    TenantShare,
)
from jobs.registry import EffectSpec, kinds, register_kind
from tests.jobs.helpers import request_job

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

KIND = "test.parity"


def _parity_report(ctx: JobContext) -> list[EffectSpec]:
    ctx.check_owner()
    ctx.store_artifact(b"parity report\n", content_type="text/plain", extension="txt")
    specs = [
        EffectSpec("report-ready", "inapp", str(r), {"title": "Report ready", "link": "/r/"})
        for r in ctx.params["recipients"]
    ]
    specs += [EffectSpec("report-mail", "email", str(r)) for r in ctx.params.get("mail", [])]
    return specs


def _kind_says_no(effect: Effect) -> str | None:
    user = policy.recipient_user(effect)
    return "no longer assigned" if user.username.startswith("gone") else None


if KIND not in kinds():
    register_kind(KIND, _parity_report, authorize_release=_kind_says_no)


_UID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def _plain(value, pk: int):
    if isinstance(value, uuid.UUID):
        return "U"  # a job's uid: new for each run, by design
    if isinstance(value, str):
        # Keys derive from the job's uid (or, for a job made before 0024, its id).
        value = re.sub(rf"job-(?:{pk}|{_UID})-", "job-J-", value)
        return re.sub(rf"^(?:{pk}|{_UID}):", "J:", value)
    return value


def _row(obj: models.Model, pk: int, **special) -> dict:
    out = {}
    for f in obj._meta.concrete_fields:
        if f.primary_key or f.is_relation:
            continue
        value = getattr(obj, f.attname)
        if f.name in special:
            out[f.name] = special[f.name](value)
        elif isinstance(f, models.DateTimeField):
            out[f.name] = value is not None
        else:
            out[f.name] = _plain(value, pk)
    return out


def snapshot(job: Job) -> dict:
    job.refresh_from_db()
    pk = job.pk
    notices = {n.effect_id: n for n in Notice.objects.filter(effect__job=job)}
    effects = []
    for e in Effect.objects.filter(job=job).order_by("effect_id"):
        assert e.idempotency_key == effect_machine.idempotency_key(e.effect_id)
        notice = notices.get(e.pk)
        if notice is not None:
            assert e.provider_ref == rules.notice_reference(notice.pk)
        events = [_row(ev, pk) for ev in EffectEvent.objects.filter(effect=e).order_by("id")]
        effects.append(
            {
                "row": _row(
                    e,
                    pk,
                    idempotency_key=lambda v: "derived",
                    provider_ref=lambda v: "notice:N" if v.startswith("notice:") else v,
                ),
                "events": events,
                "notice": None if notice is None else _row(notice, pk),
                "messages": sum(
                    1
                    for m in OrmQ.objects.all()
                    if m.func() == "jobs.tasks.release_effect" and m.args() == (e.pk,)
                ),
            }
        )
    return {
        "job": _row(job, pk, subject_id=lambda v: "S", lease_owner=lambda v: v),
        "attempts": [_row(a, pk) for a in Attempt.objects.filter(job=job).order_by("id")],
        "artifacts": [_row(a, pk) for a in Artifact.objects.filter(job=job)],
        "effects": effects,
    }


SCENARIOS = {
    # name: (recipients as username prefixes, mail to the first, deactivate the last before publish)
    "success": (["keep", "keep"], False, False),
    "withheld_by_the_kind": (["keep", "gone"], False, False),
    "deactivated_before_publish": (["keep", "keep"], False, True),
    "external_effect": (["keep"], True, False),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_publish__both_executors_write_the_same_rows(scenario, monkeypatch):
    prefixes, mail, deactivate_last = SCENARIOS[scenario]
    user_model = get_user_model()
    users = [
        user_model.objects.create_user(username=f"{p}-{scenario}-{i}")
        for i, p in enumerate(prefixes)
    ]
    real_carry_out = publish.carry_out
    snapshots, used_by = {}, {}
    for n, forced in enumerate(("postgres", "orm")):
        user_model.objects.filter(pk__in=[u.pk for u in users]).update(is_active=True)
        used: list[str] = []

        def carry_out(plan, executor=None, _forced=forced, _used=used):
            result = real_carry_out(plan, executor=_forced)
            _used.append(f"{result.executor}:{result.status.value}")
            return result

        def before_publish(stage, ctx):
            if stage == "before_publish" and deactivate_last:
                user_model.objects.filter(pk=users[-1].pk).update(is_active=False)

        monkeypatch.setattr(publish, "carry_out", carry_out)
        job, _ = request_job(
            KIND,
            subject_type="parity",
            subject_id=f"{scenario}-{n}",
            params={
                "recipients": [u.pk for u in users],
                "mail": [users[0].pk] if mail else [],
            },
        )
        assert run_delivery(job.pk, worker="w-parity", on_stage=before_publish).outcome == (
            "succeeded"
        )
        snapshots[forced], used_by[forced] = snapshot(job), used
    assert snapshots["postgres"] == snapshots["orm"]
    assert used_by["orm"][-1] == "orm:won"
    # An effect left to a sender (the mail one) goes in the statement too: its wake-up is
    # the statement's NOTIFY, not a queue message.
    if deactivate_last:  # refused in the statement, then built again and published there
        assert used_by["postgres"] == ["postgres:accounts_refused", "postgres:won"]
        assert used_by["orm"] == ["orm:accounts_refused", "orm:won"]
    else:
        assert used_by["postgres"] == ["postgres:won"]
    by_user = {u.pk: i for i, u in enumerate(users)}
    states = sorted(
        (by_user[int(e["row"]["recipient"])], e["row"]["name"], e["row"]["state"])
        for e in snapshots["orm"]["effects"]
    )
    expected = {
        "success": [(0, "report-ready", "applied"), (1, "report-ready", "applied")],
        "withheld_by_the_kind": [(0, "report-ready", "applied"), (1, "report-ready", "withheld")],
        "deactivated_before_publish": [
            (0, "report-ready", "applied"),
            (1, "report-ready", "withheld"),
        ],
        "external_effect": [(0, "report-mail", "pending"), (0, "report-ready", "applied")],
    }[scenario]
    assert states == expected


def test_refusal__only_the_meant_refusals_make_the_statement_give_way():
    """A row locked elsewhere or a recipient deleted mid-publish: the ORM executor takes
    over. A lost connection is an error, never a refusal (it propagates)."""
    from django.db import OperationalError
    from psycopg import errors

    def wrapped(cause):
        exc = OperationalError(str(cause))
        exc.__cause__ = cause
        return exc

    assert refusals.refusal(wrapped(errors.LockNotAvailable("locked"))) == "lock_not_available"
    assert refusals.refusal(wrapped(errors.ForeignKeyViolation("gone"))) == "foreign_key_violation"
    assert refusals.refusal(wrapped(errors.AdminShutdown("terminating connection"))) is None
    assert refusals.refusal(OperationalError("server closed the connection unexpectedly")) is None


def test_carry_out__a_lost_connection_propagates(monkeypatch, django_user_model):
    from django.db import OperationalError

    def lost(plan):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(postgres, "_publish_in_one", lost)
    user = django_user_model.objects.create_user(username="lost-connection")
    job, _ = request_job(
        KIND, subject_type="parity", subject_id="lost", params={"recipients": [user.pk]}
    )
    with pytest.raises(OperationalError):
        run_delivery(job.pk, worker="w-lost")
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING, "nothing published; the lease runs out, then a reclaim"
    assert not Effect.objects.filter(job=job).exists()


# --- claim -------------------------------------------------------------------------------

CLAIM_KIND = "test.contract"
if CLAIM_KIND not in kinds():
    register_kind(CLAIM_KIND, lambda ctx: [])

FAR = 3600.0  # seconds: a rule whose start was "just taken" is not due again in the test


def _rule(
    scope: str, *, rate=None, period=60.0, concurrency=None, paused=False, spent=False, weight=None
):
    """A flow rule row as an operator leaves it; ``spent``: its next start is an hour away."""
    from datetime import timedelta

    from django.utils import timezone

    return FlowRule.objects.create(
        scope=scope,
        rate=rate,
        period_seconds=period,
        concurrency=concurrency,
        paused=paused,
        weight=weight,
        next_free_at=timezone.now() + timedelta(seconds=FAR) if spent else None,
    )


# name: (rules, jobs as (subject, tenant, setup), tenant bound, what the claims mean)
# setup: "" (queued, due) | "running" (a live lease elsewhere) | "expired" (a dead owner's
# lease) | "spent" (budget used up) | "later" (due in an hour)
CLAIM_SCENARIOS = {
    "kind rate + tenant rate: the tenant's refusal keeps the kind's start": (
        [("kind:test.contract", {"rate": 1}), ("tenant:t1", {"rate": 1, "spent": True})],
        [("a", "t1", ""), ("b", "t2", "")],
        4,
        ["deferred:rate_limited@tenant:t1", "claimed"],
    ),
    "kind rate + tenant rate: both allow, one start from each": (
        [("kind:test.contract", {"rate": 1}), ("tenant:t1", {"rate": 1})],
        [("a", "t1", ""), ("b", "t1", "")],
        4,
        ["claimed", "deferred:rate_limited@kind:test.contract"],
    ),
    "kind concurrency + kind rate: refused by concurrency, no start spent": (
        [("kind:test.contract", {"rate": 2, "period": 1.0, "concurrency": 1})],
        [("a", "", ""), ("b", "", "")],
        4,
        ["claimed", "deferred:flow_concurrency@kind:test.contract"],
    ),
    "tenant concurrency + kind rate: the tenant's bound, no start spent": (
        [("kind:test.contract", {"rate": 1000, "period": 1.0}), ("tenant:t1", {"concurrency": 1})],
        [("a", "t1", ""), ("b", "t1", ""), ("c", "t2", "")],
        4,
        ["claimed", "deferred:flow_concurrency@tenant:t1", "claimed"],
    ),
    "paused tenant + kind rate: paused, no start spent": (
        [("kind:test.contract", {"rate": 1}), ("tenant:t1", {"paused": True})],
        [("a", "t1", ""), ("b", "t2", "")],
        4,
        ["deferred:flow_paused@tenant:t1", "claimed"],
    ),
    "paused kind": (
        [("kind:test.contract", {"paused": True})],
        [("a", "", "")],
        4,
        ["deferred:flow_paused@kind:test.contract"],
    ),
    "the setting's tenant bound, no rule": (
        [],
        [("a", "t1", ""), ("b", "t1", ""), ("c", "t2", "")],
        1,
        ["claimed", "deferred:@tenant:t1", "claimed"],
    ),
    "refusals: running elsewhere, not due, budget spent, expired lease": (
        [("kind:test.contract", {"rate": 1})],
        [("a", "", "running"), ("b", "", "later"), ("c", "", "spent"), ("d", "", "expired")],
        4,
        ["duplicate", "duplicate", "buried", "claimed"],
    ),
    "own verdict: an expired lease and a spent budget keep their delivery": (
        [],
        [("a", "", "expired"), ("b", "", "spent"), ("c", "", "prio:10")],
        4,
        ["claimed", "buried", "claimed"],
    ),
    "queue concurrency: queue:default at 1": (
        [("queue:default", {"concurrency": 1})],
        [("a", "", ""), ("b", "", ""), ("c", "", "queue:reports")],
        4,
        ["claimed", "deferred:flow_concurrency@queue:default", "claimed"],
    ),
}


# The next-job claim (a cluster's dequeue, ``pgclaim.claim_next`` / ``ormclaim.claim_next``):
# each line claims the next job of the queue of the job at its place; "~x": job x was
# taken (docs/app/scheduling.md: effective priority, then due time); "none": nothing due.
NEXT_CLAIM_SCENARIOS = {
    "priority: the higher job first, equals in due order": (
        [],
        [("a", "", ""), ("b", "", ""), ("c", "", "prio:10")],
        4,
        ["claimed~c", "claimed~a", "claimed~b"],
    ),
    "aging: a low job that waited 13 levels outranks a fresh high one, 10.5 too": (
        [],
        [("b", "", "prio:10"), ("a", "", "aged:10.5"), ("c", "", "aged:13")],
        4,
        ["claimed~c", "claimed~a", "claimed~b"],
    ),
    "queues: a claim takes only a job of its queue": (
        [],
        [("a", "", "prio:-5"), ("b", "", "queue:reports"), ("c", "", "queue:reports,prio:50")],
        4,
        ["claimed~a", "claimed~c", "claimed~b"],
    ),
    "the best job held by its tenant's rule: deferred, the next claim takes another": (
        [("tenant:t1", {"concurrency": 1})],
        [("a", "t1", "running"), ("b", "t2", ""), ("c", "t1", "prio:10")],
        4,
        ["deferred:flow_concurrency@tenant:t1~c", "claimed~b", "none"],
    ),
    # The fair share across tenants (docs/app/fairness.md): start-time fair queueing.
    "fair share: a tenant's second job waits for another tenant's first": (
        [],
        [("a", "t1", ""), ("b", "t1", ""), ("c", "t2", "")],
        4,
        ["claimed~a", "claimed~c", "claimed~b"],
    ),
    "fair share: tenant:t1 at weight 2 takes two claims to t2's one": (
        [("tenant:t1", {"weight": 2})],
        [(x, "t1", "") for x in "abcd"] + [(x, "t2", "") for x in "ef"],
        4,
        ["claimed~a", "claimed~e", "claimed~b", "claimed~c", "claimed~f", "claimed~d"],
    ),
    "fair share: tenant:* sets the default weight, a tenant's own rule wins": (
        [("tenant:*", {"weight": 2}), ("tenant:t1", {"weight": 1})],
        [("a", "t1", ""), ("b", "t1", ""), ("c", "t2", ""), ("d", "t2", ""), ("e", "t2", "")],
        4,
        ["claimed~a", "claimed~c", "claimed~d", "claimed~b", "claimed~e"],
    ),
    "fair share within the priority band: the band first, then the tenants' turns": (
        [],
        [("a", "t1", ""), ("b", "t1", "prio:10"), ("c", "t2", "")],
        4,
        ["claimed~b", "claimed~c", "claimed~a"],
    ),
    # One tenant waiting: the plain order, charged once for its first row and then not
    # (docs/app/fairness.md, what the fair share costs); a tenant whose finish tag lags
    # the virtual time is charged alone until it has caught up.
    "fair share, one tenant waiting: the plain order, charged only for its first row": (
        [],
        [("a", "t1", ""), ("b", "t1", "prio:10"), ("c", "t1", "aged:13")],
        4,
        ["claimed~c", "claimed~b", "claimed~a"],
    ),
    "fair share, one tenant waiting and lagging: charged until it has caught up": (
        [
            ("share:t1", {"start": 0.0, "finish": 1.0, "claims": 1}),
            ("share:t2", {"start": 2.0, "finish": 3.0, "claims": 1}),
        ],
        [(x, "t1", "") for x in "abcd"],
        4,
        ["claimed~a", "claimed~b", "claimed~c", "claimed~d"],
    ),
    "fair share: a tenant at its concurrency bound goes last in its band": (
        [("tenant:t1", {"concurrency": 1})],
        [("x", "t1", "running"), ("a", "t1", ""), ("c", "t2", "")],
        4,
        ["claimed~c", "deferred:flow_concurrency@tenant:t1~a", "none"],
    ),
}


def _prepare(setup: str, job: Job) -> None:
    from datetime import timedelta

    from django.db.models import F
    from django.db.models.functions import Now

    if "," in setup:
        for part in setup.split(","):
            _prepare(part, job)
        return
    if setup.startswith("prio:"):
        Job.objects.filter(pk=job.pk).update(priority=int(setup.removeprefix("prio:")))
    elif setup.startswith("queue:"):
        Job.objects.filter(pk=job.pk).update(queue=setup.removeprefix("queue:"))
    elif setup.startswith("aged:"):
        # Waiting that many levels of effective priority (rules.aging_seconds each).
        levels = float(setup.removeprefix("aged:"))
        waited = timedelta(seconds=levels * rules.aging_seconds())
        Job.objects.filter(pk=job.pk).update(
            created_at=F("created_at") - waited, next_attempt_at=F("next_attempt_at") - waited
        )
    elif setup == "running":
        Job.objects.filter(pk=job.pk).update(
            state=Job.State.RUNNING,
            lease_owner="elsewhere",
            attempts=1,
            lease_expires_at=Now() + timedelta(seconds=FAR),
        )
    elif setup == "expired":
        Job.objects.filter(pk=job.pk).update(
            state=Job.State.RUNNING,
            lease_owner="dead",
            attempts=1,
            lease_expires_at=Now() - timedelta(seconds=5),
        )
        Attempt.objects.create(job=job, number=1, worker="dead", started_at=Now())
    elif setup == "spent":
        Job.objects.filter(pk=job.pk).update(
            state=Job.State.RETRY_WAIT, attempts=3, max_attempts=3, next_attempt_at=Now()
        )
    elif setup == "later":
        Job.objects.filter(pk=job.pk).update(next_attempt_at=Now() + timedelta(seconds=FAR))


def _run_claims(name: str, executor: str, settings, caplog, *, next_claim: bool = False) -> dict:
    """Set the scenario up afresh, claim every job once in order through ``executor`` (by
    name, or ``next_claim``: its queue's next job), and return every row it left, by
    meaning."""
    scenarios = NEXT_CLAIM_SCENARIOS if next_claim else CLAIM_SCENARIOS
    rules_spec, jobs_spec, bound, _ = scenarios[name]
    Job.objects.filter(kind=CLAIM_KIND).delete()
    FlowRule.objects.all().delete()
    TenantShare.objects.all().delete()
    for scope, options in rules_spec:
        if scope.startswith("share:"):  # a tenant's fair-share tags, as earlier claims left them
            TenantShare.objects.create(queue="default", tenant_key=scope[6:], **options)
            continue
        _rule(scope, **options)
    settings.JOBS_TENANT_CONCURRENCY = bound
    # The ORM claim's transaction gets the idle timeout of these claims' 30 s lease, not
    # of the suite's 2 s one: a loaded host may pause it between statements.
    settings.JOBS_TRANSACTION_IDLE_SECONDS = 7.5
    created = []
    for subject, tenant, setup in jobs_spec:
        job, _ = request_job(
            CLAIM_KIND, subject_type="contract", subject_id=subject, tenant_key=tenant
        )
        _prepare(setup, job)
        created.append(job)
    chosen = executors.by_name(executor)
    if next_claim:
        from jobs.executors import ormclaim, pgclaim

        claims = pgclaim if executor == "postgres" else ormclaim
    outcomes, taken = [], []
    for job in created:
        before = dict(FlowRule.objects.values_list("scope", "next_free_at"))
        caplog.clear()
        with caplog.at_level("INFO", logger="jobs.transitions"):
            if next_claim:
                queue = Job.objects.get(pk=job.pk).queue
                got = claims.claim_next(queue, f"w-{executor}", lease=30.0, bound=bound)
            else:
                got = chosen.claim(job.pk, f"w-{executor}", lease=30.0, bound=bound)
        after = dict(FlowRule.objects.values_list("scope", "next_free_at"))
        taken.append(sorted(s for s in after if after[s] != before.get(s)))
        if got is None:
            outcomes.append("none")
            continue
        outcome = got.status
        if got.status == "deferred":
            # The scope that held it, as the engine's log line names it for operators.
            (line,) = [r.getMessage() for r in caplog.records if "arrow=defer" in r.getMessage()]
            scope = line.split("scope=", 1)[1].split()[0]
            outcome = f"deferred:{got.hold.code}@{scope}"
        if got.job is not None and (next_claim or got.job.pk != job.pk):
            outcome += f"~{got.job.subject_id}"
        outcomes.append(outcome)
    jobs = [
        _row(j, j.pk, subject_id=lambda v: v, lease_owner=lambda v: v.replace(executor, "X"))
        for j in Job.objects.filter(kind=CLAIM_KIND).order_by("subject_id")
    ]
    attempts = [
        {**_row(a, a.job_id, worker=lambda v: v.replace(executor, "X")), "job": a.job.subject_id}
        for a in Attempt.objects.filter(job__kind=CLAIM_KIND).select_related("job").order_by("id")
    ]
    shares = list(
        TenantShare.objects.order_by("queue", "tenant_key").values_list(
            "queue", "tenant_key", "start", "finish", "weight", "claims"
        )
    )
    return {
        "outcomes": outcomes,
        "taken": taken,
        "jobs": jobs,
        "attempts": attempts,
        "shares": shares,
    }


@pytest.mark.parametrize("name", list(CLAIM_SCENARIOS))
def test_claim__both_executors_write_the_same_rows(name, settings, caplog):
    expected = CLAIM_SCENARIOS[name][3]
    on_postgres = _run_claims(name, "postgres", settings, caplog)
    on_orm = _run_claims(name, "orm", settings, caplog)
    assert on_postgres["outcomes"] == expected, on_postgres
    assert on_orm == on_postgres


@pytest.mark.parametrize("name", list(NEXT_CLAIM_SCENARIOS))
def test_next_claim__both_executors_take_the_same_jobs_in_the_same_order(name, settings, caplog):
    """The one queue's dequeue on both executors: the same jobs, the same verdicts, every
    row the same (the named claim never swaps: it takes exactly its job)."""
    expected = NEXT_CLAIM_SCENARIOS[name][3]
    on_postgres = _run_claims(name, "postgres", settings, caplog, next_claim=True)
    on_orm = _run_claims(name, "orm", settings, caplog, next_claim=True)
    assert on_postgres["outcomes"] == expected, on_postgres
    assert on_orm == on_postgres


@pytest.mark.parametrize(
    "name, shares",
    [
        (
            "fair share, one tenant waiting: the plain order, charged only for its first row",
            [("default", "t1", 0.0, 1.0, 1.0, 1)],
        ),
        (
            "fair share, one tenant waiting and lagging: charged until it has caught up",
            [("default", "t1", 1.0, 2.0, 1.0, 2), ("default", "t2", 2.0, 3.0, 1.0, 1)],
        ),
    ],
)
def test_next_claim__a_tenant_alone_is_charged_only_while_it_lags(name, shares, settings, caplog):
    """Fewer than two tenants waiting, the claim charges nothing once the tenant has a row
    (the pick's cost, only paid under contention), but a tenant behind the virtual time
    catches up first."""
    settings.JOBS_FAIR_SHARE = True
    for executor in ("postgres", "orm"):
        assert _run_claims(name, executor, settings, caplog, next_claim=True)["shares"] == shares


# --- the owner fence inside a private read (JobContext.read) ------------------------------


def _fence_cases(job: Job) -> dict[str, tuple[Job, str]]:
    """The job as its worker holds it, and every way the hold can be gone."""
    held = Job.objects.get(pk=job.pk)
    stale = Job.objects.get(pk=job.pk)
    stale.version -= 1
    return {
        "held": (held, "w-fence"),
        "another worker": (held, "w-other"),
        "old version": (stale, "w-fence"),
    }


def test_held_while__both_executors_agree_on_every_case(django_user_model):
    """``held_while`` (the PostgreSQL executor's rendered text, the ORM's ``Exists``) says
    what ``still_owner`` says, held or not, whatever took the hold away."""
    user = django_user_model.objects.create_user(username="fence-parity")
    job, _ = request_job(KIND, subject_type="test", subject_id=9001, params={"recipients": []})
    claim = postgres.claim(job.pk, "w-fence", lease=30.0, bound=4)
    assert claim.won
    users = get_user_model().objects.filter(pk=user.pk)

    def answers() -> dict[str, tuple]:
        out = {}
        for case, (row, worker) in _fence_cases(claim.job).items():
            out[case] = tuple(
                (
                    executors.by_name(name).still_owner(row, worker),
                    users.filter(executors.by_name(name).held_while(row, worker)).exists(),
                )
                for name in ("postgres", "orm")
            )
        return out

    assert answers() == {
        "held": ((True, True), (True, True)),
        "another worker": ((False, False), (False, False)),
        "old version": ((False, False), (False, False)),
    }
    expires = Job.objects.values_list("lease_expires_at", flat=True).get(pk=job.pk)
    Job.objects.filter(pk=job.pk).update(lease_expires_at=expires.replace(year=2000))
    assert set(answers()["held"]) == {(False, False)}, "an expired lease holds nothing"
    Job.objects.filter(pk=job.pk).update(state=Job.State.SUCCEEDED)
    assert set(answers()["held"]) == {(False, False)}, "a finished job is held by nobody"


# --- the one queue's next-job claim, the same on both executors ------------------------


def _next_claims(executor: str):
    """The next-job claims (the claiming brokers' dequeue) of ``executor``."""
    from jobs.executors import ormclaim, pgclaim

    return pgclaim if executor == "postgres" else ormclaim


@pytest.mark.parametrize("executor", ["postgres", "orm"])
def test_next_claim__an_operators_cancel_in_flight__spends_no_start_defers_nothing(executor):
    """The race of the issue that made the jobs table the one queue: an operator cancels
    job a (its transaction holds a's row, not yet committed) while a claim takes the
    queue's next job, under a rate of one start an hour. Then the cancel commits and the
    cluster claims again. On both executors: a is cancelled and never started, b is
    claimed once, the hour's one start went to b, nothing is deferred. (Before, the
    claim's admission took the hour's start for a before anything held a's row, and the
    fallback deferred b by about an hour on that spent start.)"""
    import threading

    from django.db import connections, transaction

    from jobs.engine import job_machine

    _rule("kind:test.contract", rate=1, period=3600.0)
    a, _ = request_job(CLAIM_KIND, subject_type="contract", subject_id="a")
    b, _ = request_job(CLAIM_KIND, subject_type="contract", subject_id="b")
    holding, commit, cancelled = threading.Event(), threading.Event(), []

    def operator():
        try:
            with transaction.atomic():
                cancelled.append(job_machine.cancel(Job.objects.get(pk=a.pk), actor="op"))
                holding.set()
                assert commit.wait(60)
        finally:
            connections["default"].close()

    thread = threading.Thread(target=operator)
    thread.start()
    claims = _next_claims(executor)
    try:
        assert holding.wait(30)
        first = claims.claim_next("default", f"w-{executor}", lease=30.0, bound=4)
    finally:
        commit.set()
        thread.join(60)
    then = claims.claim_next("default", f"w-{executor}", lease=30.0, bound=4)
    a.refresh_from_db()
    b.refresh_from_db()
    assert cancelled == [True]
    assert (first.status, first.job.pk) == ("claimed", b.pk)
    assert then is None, then
    assert (a.state, a.attempts, b.state, b.attempts) == (
        Job.State.CANCELLED,
        0,
        Job.State.RUNNING,
        1,
    )
    outcomes = list(Attempt.objects.filter(job__kind=CLAIM_KIND).values_list("job_id", "outcome"))
    assert outcomes == [(b.pk, "")], outcomes
    rule = FlowRule.objects.get(scope="kind:test.contract")
    assert rule.next_free_at is not None  # one start taken: b's


@pytest.mark.parametrize("executor", ["postgres", "orm"])
def test_next_claim__a_paused_scope_of_10000_jobs__is_not_read(executor):
    """10,000 jobs of a paused kind wait in the queue; the claim of another kind's job
    reads a handful of job rows (the pause holds them out of the claim's indexes), takes
    that job, and writes nothing for any held job: no attempt, no deferral."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    import jobs
    from jobs import flow
    from jobs.engine import named_claim
    from jobs.executors import pgclaim
    from tests.jobs.helpers import scans_of

    jobs.request_many([{"kind": CLAIM_KIND, "subject": ("contract", k)} for k in range(10_000)])
    flow.pause(f"kind:{CLAIM_KIND}", actor="test")
    other, _ = request_job(KIND, subject_type="contract", subject_id="other")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")
    if executor == "postgres":
        scans = scans_of(*pgclaim.next_statement("default", "w1", lease=30, bound=4))
    else:
        candidates = Job.objects.filter(rules.to_q(rules.CLAIMABLE), queue="default")
        scans = []
        for order in (named_claim._BY_PRIORITY, named_claim._BY_WAIT):
            scans += scans_of(*candidates.order_by(*order)[:1].query.sql_with_params())
    assert scans and max(rows for _, _, rows in scans) <= 5, scans
    with CaptureQueriesContext(connection) as queries:
        claim = _next_claims(executor).claim_next("default", "w1", lease=30.0, bound=4)
    assert claim.won and claim.job.pk == other.pk
    # The fair order (docs/app/fairness.md) reads each waiting tenant's head and the
    # tenants' tags, and charges the tenant: on the ORM 19 statements for this first
    # claim of the queue (its share row inserted in a savepoint), 12 without it.
    assert len(queries) <= (19 if executor == "orm" else 12), [q["sql"][:80] for q in queries]
    assert Job.objects.filter(held_by=f"kind:{CLAIM_KIND}").count() == 10_000
    assert list(Attempt.objects.values_list("job_id", flat=True)) == [other.pk]


# --- sequences: the claim takes a key's jobs in request order, each once the one before
# passed (docs/app/sequences.md) ------------------------------------------------------------

SEQ_KIND, SEQ_SKIP_KIND = "test.contract.seq", "test.contract.seq-skip"
if SEQ_KIND not in kinds():
    register_kind(SEQ_KIND, lambda ctx: [], sequence=lambda params, subject: params["key"])
    register_kind(
        SEQ_SKIP_KIND,
        lambda ctx: [],
        sequence=lambda params, subject: params["key"],
        on_failure="skip",
    )

# name: (jobs as (subject, key, skip)), steps (";" between). A step: "claim~x" (the next
# claim takes x), "claim~none" (nothing), "end x STATE" (x ended so, as its worker leaves
# it), "effect x STATE" (x's one effect is in that state now), "release x" (an operator's
# release of x).
SEQUENCE_SCENARIOS = {
    "one key: request order, one at a time; another key goes on": (
        [("a", "k1", False), ("b", "k1", False), ("c", "k1", False), ("x", "k2", False)],
        "claim~a claim~x claim~none; end a succeeded; claim~b claim~none; end b succeeded; claim~c",
    ),
    "an effect pending, sending or unknown holds the next; settled lets it go": (
        [("a", "k1", False), ("b", "k1", False), ("c", "k1", False)],
        "claim~a; end a succeeded; effect a pending; claim~none; effect a sending; claim~none; "
        "effect a unknown; claim~none; effect a applied; claim~b; end b succeeded; "
        "effect b needs_review; claim~c",
    ),
    "withheld and failed effects are settled too": (
        [("a", "k1", False), ("b", "k1", False)],
        "claim~a; end a succeeded; effect a withheld; claim~b",
    ),
    "a dead job holds its key until an operator releases it": (
        [("a", "k1", False), ("b", "k1", False), ("x", "k2", False)],
        "claim~a; end a dead; claim~x claim~none; release a; claim~b",
    ),
    "on_failure=skip: a failed job lets its key go on": (
        [("a", "k1", True), ("b", "k1", True)],
        "claim~a; end a failed; claim~b",
    ),
    "a cancelled job lets its key go on; a running one holds it": (
        [("a", "k1", False), ("b", "k1", False), ("c", "k1", False)],
        "claim~a claim~none; end a cancelled; claim~b claim~none",
    ),
}


def _steps_of(part: str) -> list[str]:
    """A scenario's part: claims ("claim~a claim~none") or one action ("end a dead")."""
    return part.split() if part.startswith("claim") else [part]


def _sequence_step(step: str, made: dict[str, Job], claims, executor: str) -> str | None:
    from django.db.models import F
    from django.db.models.functions import Now

    from jobs import sequences

    verb, *rest = step.split()
    if verb.startswith("claim"):
        got = claims.claim_next("default", f"w-{executor}", lease=30.0, bound=4)
        return (
            "claim~none"
            if got is None
            else f"claim~{got.job.subject_id}" + ("" if got.won else f" ({got.status})")
        )
    job = made[rest[0]]
    if verb == "end":
        Job.objects.filter(pk=job.pk).update(
            state=rest[1], version=F("version") + 1, finished_at=Now(), lease_expires_at=None
        )
    elif verb == "effect":
        Effect.objects.update_or_create(
            job=job,
            effect_id=f"{job.uid}:seq",
            defaults={
                "name": "seq",
                "provider": "email",
                "recipient": "1",
                "state": rest[1],
                "idempotency_key": f"{job.uid}:seq",
            },
        )
    elif verb == "release":
        assert sequences.release(Job.objects.get(pk=job.pk), operator="op")
    return None


@pytest.mark.parametrize("name", list(SEQUENCE_SCENARIOS))
def test_sequence_claim__both_executors_decide_the_same(name, settings):
    import jobs
    from jobs.executors import ormclaim, pgclaim

    made_jobs, text = SEQUENCE_SCENARIOS[name]
    steps = [s for part in text.split(";") for s in _steps_of(part.strip())]
    settings.JOBS_TRANSACTION_IDLE_SECONDS = 7.5
    records = {}
    for executor, claims in (("postgres", pgclaim), ("orm", ormclaim)):
        Job.objects.filter(kind__in=(SEQ_KIND, SEQ_SKIP_KIND)).delete()
        made = {}
        for subject, key, skip in made_jobs:
            kind = SEQ_SKIP_KIND if skip else SEQ_KIND
            made[subject] = jobs.request(kind, ("seq", subject), params={"key": key}).job
        seen = [_sequence_step(step, made, claims, executor) for step in steps]
        who = {"lease_owner": lambda v, e=executor: v.replace(e, "X")}
        rows = [
            _row(j, j.pk, subject_id=lambda v: v, **who)
            for j in Job.objects.filter(kind__in=(SEQ_KIND, SEQ_SKIP_KIND)).order_by("id")
        ]
        assert [s for s in seen if s] == [s for s in steps if s.startswith("claim")], executor
        Effect.objects.filter(job__kind__in=(SEQ_KIND, SEQ_SKIP_KIND)).delete()
        records[executor] = rows
    assert records["orm"] == records["postgres"]
