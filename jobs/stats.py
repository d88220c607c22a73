"""Figures an operator watches: deliveries and effects, counted apart."""

from __future__ import annotations

from django.db.models import Count, Q, Sum

from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job

Action = EffectEvent.Action


def collect_providers() -> dict[str, dict]:
    """Per provider: effects (outcomes) and sends (calls) apart.

    ``sends`` counts calls; ``resends`` the calls beyond the first for one effect,
    always under the same key (expected under faults); ``lookups`` the questions "what
    became of this key?" asked instead of a resend (no sends); ``duplicate_effects`` counts
    effect identities with a second ledger row or a second applied outcome (must be 0).
    """
    out: dict[str, dict] = {}

    def row(provider: str) -> dict:
        return out.setdefault(
            provider,
            {
                "effects": 0,
                "by_state": {},
                "sends": 0,
                "resends": 0,
                "lookups": 0,
                "withheld_before_send": 0,
                "operator_actions": 0,
                "duplicate_effects": 0,
            },
        )

    for provider, state, n in (
        Effect.objects.values_list("provider", "state").annotate(n=Count("id")).order_by()
    ):
        row(provider)["by_state"][state] = n
        row(provider)["effects"] += n
    events = EffectEvent.objects.values("provider").order_by()
    for r in events.annotate(
        sends=Count("id", filter=Q(action=Action.SEND)),
        sent_effects=Count("effect", filter=Q(action=Action.SEND), distinct=True),
        lookups=Count("id", filter=Q(action=Action.LOOKUP)),
        withheld=Count("id", filter=Q(action=Action.WITHHOLD)),
        operator=Count(
            "id", filter=Q(action__in=[Action.MARK_SENT, Action.SEND_AGAIN, Action.RECHECK])
        ),
    ):
        p = row(r["provider"])
        p["sends"] = r["sends"]
        p["resends"] = r["sends"] - r["sent_effects"]
        p["lookups"] = r["lookups"]
        p["withheld_before_send"] = r["withheld"]
        p["operator_actions"] = r["operator"]
    twice_applied = (
        EffectEvent.objects.filter(outcome=Effect.State.APPLIED)
        .values("provider", "effect")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .order_by()
    )
    for r in twice_applied:
        row(r["provider"])["duplicate_effects"] += 1
    two_rows = (
        Effect.objects.values("provider", "effect_id")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .order_by()
    )
    for r in two_rows:
        row(r["provider"])["duplicate_effects"] += 1
    return out


def artifact_figures() -> dict:
    """Artifact rows by state and orphan files (named by no row; ``jobs_prune`` collects them)."""
    from jobs.retention import orphans

    return {
        "by_state": dict(Artifact.objects.values_list("state").annotate(n=Count("id")).order_by()),
        "orphan_files": len(orphans()),
    }


def collect(*, artifacts: bool = False) -> dict:
    """Jobs by state, deliveries, duplicate deliveries, retries by class, effects by state.

    ``artifacts`` adds the artifact figures (``manage.py jobs_stats`` asks for them);
    counting orphans lists the artifact storage, too slow for every /metrics scrape.
    """
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
    # An effect identity is unique in the ledger and applied at most once by CAS;
    # count both anyway, so the figure is measured rather than assumed.
    providers = collect_providers()
    duplicate_effects = sum(p["duplicate_effects"] for p in providers.values())
    failed = failed_deliveries()
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
        "failed_deliveries": sum(failed.values()),
        "failed_deliveries_by_task": failed,
        "retries_by_class": retries,
        "effects": {
            "total": Effect.objects.count(),
            "by_state": dict(
                Effect.objects.values_list("state").annotate(n=Count("id")).order_by()
            ),
            "by_provider": by_provider,
        },
        "providers": providers,
        "provider_in_flight": provider_in_flight(),
        "duplicate_effects": duplicate_effects,
        **({"artifacts": artifact_figures()} if artifacts else {}),
    }


def failed_deliveries() -> dict[str, int]:
    """Deliveries that raised or timed out instead of returning an outcome, per task.

    Mostly failures before the claim (the database refused the connection: too
    many clients, a restart), which leave no attempt row. django-q2 records each
    (``Failure`` rows, one per message, ``attempt_count`` per delivery) and hands
    the message out again after ``Q_CLUSTER['retry']``. A failure its monitor
    could not save either (the database was gone for it too) is only in the log.
    """
    from django_q.models import Failure

    rows = (
        Failure.objects.filter(func__startswith="jobs.tasks.")
        .values_list("func")
        .annotate(n=Sum("attempt_count"))
        .order_by()
    )
    return {func.removeprefix("jobs.tasks."): n for func, n in rows}


def provider_in_flight() -> dict[str, int]:
    """Calls in flight now, per bounded provider (held in-flight slots)."""
    from jobs import registry
    from jobs.providers.bounds import in_flight_now

    out = {}
    for name, provider in registry.providers().items():
        limit = provider.in_flight_limit()
        if limit:
            out[name] = in_flight_now(name, int(limit))
    return out
