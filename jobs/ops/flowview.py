"""Flow rules as operators see them: each scope's rule with what it holds right now.

Read by ``manage.py jobs_limits show``, the console's flow section and ``/metrics``.
Figures come from the record (live job leases, attempt rows, effect events, the
provider's held slots), judged by the database server's clock. Reads only.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Q

from jobs import clock, conf, registry, rules
from jobs.models import Attempt, Effect, EffectEvent, FlowRule, Job

WINDOW_SECONDS = 60.0


@dataclass
class ScopeView:
    scope: str
    rule: FlowRule | None
    concurrency: int | None  # the bound in force (row or settings), None: unbounded
    concurrency_source: str  # "rule" | "settings" | ""
    in_flight: int
    started_last_minute: int
    waiting: int

    @property
    def paused(self) -> bool:
        return bool(self.rule and self.rule.paused)

    @property
    def rate(self) -> str:
        if self.rule is None or not self.rule.rate:
            return ""
        return f"{self.rule.rate}/{self.rule.period_seconds:g}s"

    @property
    def weight(self) -> str:
        """A tenant's fair-share weight (its rule's; ``(default)`` when the default applies)."""
        if not self.scope.startswith(rules.FLOW_TENANT_PREFIX):
            return ""
        if self.rule is not None and self.rule.weight is not None:
            return str(self.rule.weight)
        return "(default)"

    @property
    def circuit(self) -> str:
        parts = rules.scope_provider(self.scope)
        if parts is None or parts[1]:  # the circuit is the whole provider's, not a partition's
            return ""
        return self.rule.circuit_state if self.rule is not None else FlowRule.Circuit.CLOSED


def _provider_limit(name: str) -> int | None:
    try:
        return registry.get_provider(name).in_flight_limit()
    except Exception:  # an unknown provider named in a rule: no default
        return None


def scope_views() -> list[ScopeView]:
    """Every rule's scope, plus each external provider (whose defaults apply without one)."""
    found = {r.scope: r for r in FlowRule.objects.all()}
    scopes = set(found)
    for name, provider in registry.providers().items():
        if not provider.transactional:
            scopes.add(rules.provider_scope(name))
    # The server's clock read once: a constant bound, which the attempts' BRIN index can take.
    since = clock.server_now() - timedelta(seconds=WINDOW_SECONDS)
    return [_view(scope, found.get(scope), since) for scope in sorted(scopes)]


def _view(scope: str, rule: FlowRule | None, since: datetime) -> ScopeView:
    live = rules.to_q(rules.LIVE_RUNNING)
    waiting_jobs = rules.to_q(rules.WAITING)
    own = rule.concurrency if rule is not None else None
    parts = rules.scope_provider(scope)
    if parts is not None:
        provider, partition = parts
        effects = Q(provider=provider)
        events = Q(provider=provider)
        if partition:
            effects &= Q(job__tenant_key=partition)
            events &= Q(effect__job__tenant_key=partition)
            bound, source = own, "rule" if own is not None else ""
            slot_name = scope
        else:
            default = _provider_limit(provider)
            bound = own if own is not None else default
            source = "rule" if own is not None else ("settings" if default else "")
            slot_name = provider
        if bound:
            from jobs.providers import bounds

            in_flight = bounds.in_flight_now(slot_name, bound)
        else:
            in_flight = Effect.objects.filter(effects, state=Effect.State.SENDING).count()
        started = EffectEvent.objects.filter(events, action=EffectEvent.Action.SEND, at__gte=since)
        waiting = Effect.objects.filter(
            effects, state__in=[Effect.State.PENDING, Effect.State.UNKNOWN]
        )
        return ScopeView(
            scope, rule, bound or None, source, in_flight, started.count(), waiting.count()
        )
    if scope.startswith("kind:"):
        mine = Q(kind=scope.removeprefix("kind:"))
        bound, source = own, "rule" if own is not None else ""
    else:
        mine = Q(tenant_key=scope.removeprefix("tenant:"))
        bound = own if own is not None else conf.tenant_concurrency()
        source = "rule" if own is not None else "settings"
    jobs = Job.objects.filter(mine)
    attempts = Attempt.objects.filter(
        number__gt=0, started_at__gte=since, **{f"job__{k}": v for k, v in mine.children}
    ).exclude(outcome__in=[Attempt.Outcome.DEFERRED, Attempt.Outcome.DUPLICATE_DELIVERY])
    return ScopeView(
        scope,
        rule,
        bound,
        source,
        jobs.filter(live).count(),
        attempts.count(),
        jobs.filter(waiting_jobs).count(),
    )
