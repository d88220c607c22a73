"""Prometheus figures, read from the engine's own tables at scrape time.

The tables are the record (attempt rows, ledger rows), so every worker process
on every machine is counted without a shared metrics registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jobs import rules, stats
from jobs.ops.flowview import scope_views


class EngineCollector:
    def collect(self):
        figures = stats.collect()

        jobs = GaugeMetricFamily("jobs_jobs", "Jobs by state", labels=["state"])
        for state, n in sorted(figures["jobs"]["by_state"].items()):
            jobs.add_metric([state], n)
        yield jobs

        deliveries = CounterMetricFamily(
            "jobs_deliveries",
            "Queue deliveries that reached a worker, by outcome",
            labels=["outcome"],
        )
        for outcome, n in sorted(figures["deliveries_by_outcome"].items()):
            deliveries.add_metric([outcome], n)
        yield deliveries

        yield CounterMetricFamily(
            "jobs_duplicate_deliveries",
            "Deliveries of a job that was finished, leased or not due (harmless)",
            value=figures["duplicate_deliveries"],
        )
        yield CounterMetricFamily(
            "jobs_lease_losses", "Workers that lost their lease", value=figures["lease_losses"]
        )

        failed = CounterMetricFamily(
            "jobs_failed_deliveries",
            "Deliveries that raised before an outcome was recorded (e.g. no database "
            "connection for the claim), by task; redelivered after Q_CLUSTER retry",
            labels=["task"],
        )
        for task, n in sorted(figures["failed_deliveries_by_task"].items()):
            failed.add_metric([task], n)
        yield failed

        retries = CounterMetricFamily(
            "jobs_retries", "Retries by error class", labels=["error_class"]
        )
        for error_class, n in sorted(figures["retries_by_class"].items()):
            retries.add_metric([error_class], n)
        yield retries

        effects = GaugeMetricFamily(
            "jobs_effects", "Ledger rows by provider and state", labels=["provider", "state"]
        )
        for provider, by_state in sorted(figures["effects"]["by_provider"].items()):
            for state, n in sorted(by_state.items()):
                effects.add_metric([provider, state], n)
        yield effects

        yield GaugeMetricFamily(
            "jobs_duplicate_effects",
            "Effect identities recorded more than once (must stay 0)",
            value=figures["duplicate_effects"],
        )

        in_flight = GaugeMetricFamily(
            "jobs_provider_in_flight", "Provider calls in flight now", labels=["provider"]
        )
        for provider, n in sorted(figures.get("provider_in_flight", {}).items()):
            in_flight.add_metric([provider], n)
        yield in_flight


class FlowCollector:
    """Each flow scope's rule and what it holds (``jobs.ops.flowview``), and each circuit."""

    def collect(self):
        views = scope_views()
        labels = ["scope"]
        families = {
            "paused": GaugeMetricFamily(
                "jobs_flow_paused", "1 when the scope is paused", labels=labels
            ),
            "bound": GaugeMetricFamily(
                "jobs_flow_concurrency",
                "The concurrency bound in force (rule or default)",
                labels=labels,
            ),
            "rate": GaugeMetricFamily(
                "jobs_flow_rate_per_second",
                "The scope's rate rule, in starts per second",
                labels=labels,
            ),
            "in_flight": GaugeMetricFamily(
                "jobs_flow_in_flight",
                "Running jobs or calls in flight under the scope now",
                labels=labels,
            ),
            "started": GaugeMetricFamily(
                "jobs_flow_started_last_minute",
                "Starts under the scope in the last minute",
                labels=labels,
            ),
            "waiting": GaugeMetricFamily(
                "jobs_flow_waiting", "Jobs or effects of the scope waiting to start", labels=labels
            ),
        }
        circuit = GaugeMetricFamily(
            "jobs_provider_circuit",
            "1 for the provider circuit's current state",
            labels=["provider", "state"],
        )
        for v in views:
            families["paused"].add_metric([v.scope], 1 if v.paused else 0)
            if v.concurrency:
                families["bound"].add_metric([v.scope], v.concurrency)
            if v.rule is not None and v.rule.rate:
                families["rate"].add_metric([v.scope], v.rule.rate / v.rule.period_seconds)
            families["in_flight"].add_metric([v.scope], v.in_flight)
            families["started"].add_metric([v.scope], v.started_last_minute)
            families["waiting"].add_metric([v.scope], v.waiting)
            if v.circuit:
                for state in ("closed", "open", "half_open"):
                    circuit.add_metric(
                        [rules.scope_provider(v.scope)[0], state], int(v.circuit == state)
                    )
        yield from families.values()
        yield circuit


def render() -> bytes:
    """The Prometheus text exposition of the engine's figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector())
    registry.register(FlowCollector())
    return generate_latest(registry)
