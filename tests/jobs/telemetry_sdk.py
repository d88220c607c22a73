"""The OpenTelemetry SDK with in-memory exporters, handed to the engine (not the globals)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from jobs import telemetry


@dataclass
class Recorded:
    exporter: object
    reader: object

    def spans(self, name: str | None = None) -> list:
        found = sorted(self.exporter.get_finished_spans(), key=lambda s: s.start_time)
        return [s for s in found if name is None or s.name == name]

    def counts(self, name: str) -> dict[tuple, int]:
        """The counter ``name``'s points: sorted attribute items → value."""
        out: dict[tuple, int] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        for point in metric.data.data_points:
                            out[tuple(sorted(point.attributes.items()))] = point.value
        return out


@pytest.fixture
def otel() -> Iterator[Recorded]:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    assert telemetry.configure(tracer_provider=tracer_provider, meter_provider=meter_provider)
    try:
        yield Recorded(exporter, reader)
    finally:
        telemetry.configure()
        tracer_provider.shutdown()
        meter_provider.shutdown()


def all_text(span) -> list[str]:
    """Every value a span carries: its name, attributes, events' and links' attributes."""
    values = [span.name, *(str(v) for v in span.attributes.values())]
    for event in span.events:
        values += [event.name, *(str(v) for v in event.attributes.values())]
    for link in span.links:
        values += [str(v) for v in link.attributes.values()]
    return values
