"""The engine's figures per kind, provider and tenant, read from its own tables.

``/metrics`` (``jobs.ops.metrics``) exports them for Prometheus, and the OpenTelemetry
gauges read the circuits and duplicate effects from here: the attempt and ledger rows
are the record, so every worker process on every host is counted once.
"""

from __future__ import annotations

from django.db.models import Count, Q

from jobs.models import Attempt, Effect, EffectEvent, FlowRule

Action = EffectEvent.Action
Labels = tuple[str, ...]


def deliveries() -> dict[Labels, int]:
    """(kind, tenant, outcome) → deliveries that reached a worker."""
    rows = (
        Attempt.objects.values_list("job__kind", "job__tenant_key", "outcome")
        .annotate(n=Count("id"))
        .order_by()
    )
    return {(kind, tenant, outcome or "running"): n for kind, tenant, outcome, n in rows}


def _effect_events(condition: Q, *, distinct: bool = True) -> dict[Labels, int]:
    """(provider, kind, tenant) → effects (or events) with an event matching ``condition``."""
    rows = (
        EffectEvent.objects.filter(condition)
        .values_list("provider", "effect__job__kind", "effect__job__tenant_key")
        .annotate(n=Count("effect", distinct=True) if distinct else Count("id"))
        .order_by()
    )
    return {(provider, kind, tenant): n for provider, kind, tenant, n in rows}


def effects_applied() -> dict[Labels, int]:
    """(provider, kind, tenant) → effects applied (the ledger's rows, not its events)."""
    rows = (
        Effect.objects.filter(state=Effect.State.APPLIED)
        .values_list("provider", "job__kind", "job__tenant_key")
        .annotate(n=Count("id"))
        .order_by()
    )
    return {(provider, kind, tenant): n for provider, kind, tenant, n in rows}


def effects_found_by_lookup() -> dict[Labels, int]:
    """Effects whose send a lookup made unnecessary: the provider had applied the key."""
    return _effect_events(Q(action=Action.LOOKUP, outcome=Effect.State.APPLIED))


def releases_withheld() -> dict[Labels, int]:
    """Releases the authorization recheck withheld (events: one effect may be rechecked)."""
    return _effect_events(Q(action=Action.WITHHOLD, outcome=Effect.State.WITHHELD), distinct=False)


def duplicate_effects() -> dict[str, int]:
    """provider → effect identities with a second ledger row or a second applied outcome."""
    out: dict[str, int] = {}
    twice_applied = (
        EffectEvent.objects.filter(outcome=Effect.State.APPLIED)
        .values("provider", "effect")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .order_by()
    )
    two_rows = (
        Effect.objects.values("provider", "effect_id")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .order_by()
    )
    for r in [*twice_applied, *two_rows]:
        out[r["provider"]] = out.get(r["provider"], 0) + 1
    for provider in Effect.objects.values_list("provider", flat=True).distinct().order_by():
        out.setdefault(provider, 0)
    return out


def circuits() -> dict[str, str]:
    """provider → its circuit's state (providers with a flow rule row)."""
    from jobs import rules

    out = {}
    rows = FlowRule.objects.filter(scope__startswith=rules.FLOW_PROVIDER_PREFIX)
    for scope, state in rows.values_list("scope", "circuit_state"):
        parts = rules.scope_provider(scope)
        if parts is not None and not parts[1]:
            out[parts[0]] = state
    return out
