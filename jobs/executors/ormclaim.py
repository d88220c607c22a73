"""The ORM claim of the next due job of a queue: the dequeue of the one queue elsewhere.

The same three claims as ``jobs.executors.pgclaim`` (next job, own verdict, effect
lease), in Django's ORM, for SQLite (and PostgreSQL through psycopg2). Each runs in one
worker transaction: on SQLite ``transaction_mode="IMMEDIATE"`` holds the only write
lock from its first read, so no other claim decides about the same job meanwhile; on
PostgreSQL the job's claim lock is tried (``named_claim._take_candidate``) and a job
another claim holds is passed over. The decision is the engine's (``verdict.decide``),
the same as every other claim's.
"""

from __future__ import annotations

from django.db.models.functions import Coalesce, Now

from jobs import clock, conf, fairness, rules, sequences
from jobs.engine import named_claim, verdict
from jobs.engine.plan import Claim
from jobs.models import Effect, Job


def claim_next(queue: str, worker: str, *, lease: float, bound: int) -> Claim | None:
    """``_claim_next``; finding none, it releases the sequences' heads that may start
    (``release_heads``) and, if it released one, looks once more (as ``pgclaim``'s)."""
    claim = _claim_next(queue, worker, lease=lease, bound=bound)
    if claim is None and release_heads():
        claim = _claim_next(queue, worker, lease=lease, bound=bound)
    return claim


def release_heads() -> int:
    """Release every sequence's head whose job before it passed (``sequences.sweep``)."""
    return sequences.sweep()


def _claim_next(queue: str, worker: str, *, lease: float, bound: int) -> Claim | None:
    """Claim ``queue``'s next due job for ``worker`` (the more urgent of its two
    candidates by effective priority), or the verdict on it; None when none is due.

    A job another claim or an operator's open transaction holds (PostgreSQL: its claim
    lock or its row, ``verdict.decide``) is passed over and the next chosen, as the
    statement's ``SKIP LOCKED`` does; ``passed`` when every look met one. With
    ``JOBS_FAIR_SHARE`` the candidates are ordered as the statement's (``jobs.fairness``):
    while two tenants wait, in the fair order; else as without it, charging only a tenant
    whose tag lags."""
    fair = conf.fair_share()
    if fair and fairness.contended(queue):
        return _claim_next_fair(queue, worker, lease=lease, bound=bound)
    if not named_claim._candidates(queue, exclude=set()):
        return None  # a read first: an idle cluster's look takes no write lock
    passed: set[int] = set()
    with clock.worker_transaction():
        for _ in range(named_claim.PASS_RACES + 1):
            found = [c.pk for c in named_claim._candidates(queue, exclude=passed)]
            if not found:
                return Claim("passed") if passed else None
            rows = Job.objects.annotate(db_now=Now(), flow_ruled=rules.flow_ruled_q())
            # Read again as claimable: through psycopg2, another claim may have started
            # one since (its own claim lock is only tried below).
            rows = list(rows.filter(rules.to_q(rules.CLAIMABLE), pk__in=found))
            if not rows:
                passed.update(found)
                continue
            now, aging = rows[0].db_now, rules.aging_seconds()
            best = min(
                rows,
                key=lambda j: (
                    -rules.effective_priority(j, now, aging),
                    rules.waiting_since(j),
                    j.pk,
                ),
            )
            job = named_claim._take_candidate(best)
            if job is not None:
                decided = verdict.decide(job, worker, now, lease=lease, bound=bound, swapped=True)
                if decided is not None:
                    if fair and decided.won and fairness.lagging(queue, job.tenant_key):
                        fairness.charge(queue, job.tenant_key)
                    return decided
            passed.add(best.pk)
    return Claim("passed")


def _claim_next_fair(queue: str, worker: str, *, lease: float, bound: int) -> Claim | None:
    """``claim_next`` in the fair share's order; the claim that starts a job charges its
    tenant in the same transaction (``fairness.charge``)."""
    if not Job.objects.filter(rules.to_q(rules.CLAIMABLE), queue=queue).exists():
        return None  # a read first: an idle cluster's look takes no write lock
    passed: set[int] = set()
    with clock.worker_transaction():
        for _ in range(named_claim.PASS_RACES + 1):
            best = fairness.pick(queue, exclude=passed, bound=bound)
            if best is None:
                return Claim("passed") if passed else None
            job = named_claim._take_candidate(best)
            if job is not None:
                decided = verdict.decide(
                    job, worker, best.db_now, lease=lease, bound=bound, swapped=True
                )
                if decided is not None:
                    if decided.won:
                        fairness.charge(queue, job.tenant_key)
                    return decided
            passed.add(best.pk)
    return Claim("passed")


def decide_own_verdict(queue: str, worker: str, *, lease: float, bound: int) -> Claim | None:
    """The queue's longest-due job that needs its own verdict (a lease that ran out, a
    spent budget), decided by the engine; None when there is none."""
    due = Job.objects.filter(rules.to_q(rules.OWN_VERDICT), queue=queue)
    if not due.exists():
        return None  # a read first, as in claim_next
    with clock.worker_transaction():
        order = Coalesce("lease_expires_at", "next_attempt_at", "created_at")
        job = (
            due.annotate(db_now=Now(), flow_ruled=rules.flow_ruled_q()).order_by(order, "pk")
        ).first()
        if job is None:
            return None
        return verdict.decide(job, worker, job.db_now, lease=lease, bound=bound, swapped=False)


def claim_effect(worker: str, *, look_first: bool = True) -> tuple[Effect, str] | None:
    """Lease the ledger's longest-due releasable effect to ``worker``: the effect and its
    state before, or None when none is due (``pgclaim.claim_effect``'s contract; it
    always looks first)."""
    from jobs.engine import effect_machine

    releasable = Effect.objects.filter(rules.to_q(rules.EFFECT_RELEASABLE))
    if not releasable.exists():
        return None  # a read first, as in claim_next
    for _ in range(4):
        with clock.worker_transaction():
            order = Coalesce("next_attempt_at", "lease_expires_at", "created_at")
            effect = releasable.select_related("job").order_by(order, "pk").first()
            if effect is None:
                return None
            prior = effect.state
            if effect_machine.claim_send(effect, worker) == "claimed":
                return effect, prior
    return None
