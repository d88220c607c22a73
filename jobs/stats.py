"""Figures an operator watches: deliveries and effects, counted apart."""

from __future__ import annotations

from django.db.models import Count

from jobs.models import Attempt, Effect, Job


def collect() -> dict:
    """Jobs by state, deliveries, duplicate deliveries, retries by class, effects by state."""
    outcomes = dict(Attempt.objects.values_list("outcome").annotate(n=Count("id")).order_by())
    retries = dict(
        Attempt.objects.filter(outcome=Attempt.Outcome.RETRY)
        .values_list("error_class")
        .annotate(n=Count("id"))
        .order_by()
    )
    by_provider: dict[str, dict[str, int]] = {}
    for provider, state, n in (
        Effect.objects.values_list("provider", "state").annotate(n=Count("id")).order_by()
    ):
        by_provider.setdefault(provider, {})[state] = n
    # An effect identity is unique in the ledger; count any key seen twice anyway, so
    # the figure is measured rather than assumed.
    duplicate_effects = (
        Effect.objects.values("effect_id").annotate(n=Count("id")).filter(n__gt=1).count()
    )
    return {
        "jobs": {
            "total": Job.objects.count(),
            "by_state": dict(Job.objects.values_list("state").annotate(n=Count("id")).order_by()),
        },
        "deliveries": sum(outcomes.values()),
        "deliveries_by_outcome": {k or "running": v for k, v in outcomes.items()},
        "duplicate_deliveries": outcomes.get(Attempt.Outcome.DUPLICATE_DELIVERY, 0),
        "lease_losses": outcomes.get(Attempt.Outcome.LEASE_LOST, 0),
        "crashes": outcomes.get(Attempt.Outcome.CRASHED, 0),
        "retries_by_class": retries,
        "effects": {
            "total": Effect.objects.count(),
            "by_state": dict(
                Effect.objects.values_list("state").annotate(n=Count("id")).order_by()
            ),
            "by_provider": by_provider,
        },
        "duplicate_effects": duplicate_effects,
    }
