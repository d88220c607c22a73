"""Prometheus figures, read from the engine's own tables at scrape time.

The tables are the record (attempt rows, ledger rows), so every worker process
on every machine is counted without a shared metrics registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jobs import rules, stats
from jobs.ops.flowview import scope_views
from jobs.telemetry import figures


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


class DetailCollector:
    """The figures per kind, provider and tenant (``jobs.telemetry.figures``): what only
    this engine knows, beside the totals above (docs/app/observability.md)."""

    KIND = ["kind", "tenant"]
    EFFECT = ["provider", "kind", "tenant"]

    def collect(self):
        deliveries = CounterMetricFamily(
            "jobs_kind_deliveries",
            "Deliveries that reached a worker, by kind, tenant and outcome",
            labels=[*self.KIND, "outcome"],
        )
        duplicates = CounterMetricFamily(
            "jobs_kind_duplicate_deliveries",
            "Second deliveries of a claimed job (recorded, did nothing), by kind and tenant",
            labels=self.KIND,
        )
        stale = CounterMetricFamily(
            "jobs_stale_attempts",
            "Attempts fenced out (their lease was lost: they published nothing)",
            labels=self.KIND,
        )
        for (kind, tenant, outcome), n in sorted(figures.deliveries().items()):
            deliveries.add_metric([kind, tenant, outcome], n)
            if outcome == "duplicate_delivery":
                duplicates.add_metric([kind, tenant], n)
            elif outcome == "lease_lost":
                stale.add_metric([kind, tenant], n)
        yield from (deliveries, duplicates, stale)
        yield self._family(
            "jobs_effects_applied", "Effects applied at their provider", figures.effects_applied()
        )
        yield self._family(
            "jobs_effects_suppressed",
            "Effects whose send a lookup made unnecessary (the provider had applied the key)",
            figures.effects_found_by_lookup(),
        )
        yield self._family(
            "jobs_releases_withheld",
            "Releases withheld by the authorization recheck",
            figures.releases_withheld(),
        )
        by_provider = GaugeMetricFamily(
            "jobs_provider_duplicate_effects",
            "Effect identities recorded or applied more than once, by provider (must stay 0)",
            labels=["provider"],
        )
        for provider, n in sorted(figures.duplicate_effects().items()):
            by_provider.add_metric([provider], n)
        yield by_provider

    def _family(self, name: str, doc: str, rows: dict) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=self.EFFECT)
        for labels, n in sorted(rows.items()):
            family.add_metric(list(labels), n)
        return family


def render() -> bytes:
    """The Prometheus text exposition of the engine's figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector())
    registry.register(FlowCollector())
    registry.register(DetailCollector())
    return generate_latest(registry)
