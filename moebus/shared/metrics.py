"""Prometheus helpers: one registry per service instance (no global default registry).

Names are prefixed `moebus_<service>_`, except names holding a ':' (recording-rule style), which
are registered as given: the vLLM-shaped `moebus:...` metrics (docs/observability.md)."""
from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Latency buckets from sub-millisecond bus hops up to long generations.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._prefix = f"moebus_{service}_"
        self.bus_messages = self.counter("bus_messages_total", "Messages handled, by endpoint and outcome",
                                         ["endpoint", "outcome"])
        self.bus_handler_seconds = self.histogram("bus_handler_seconds", "Handler latency", ["endpoint"])

    def _name(self, name: str) -> str:
        return name if ":" in name else self._prefix + name

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self._name(name), doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self._name(name), doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(self._name(name), doc, labels, buckets=buckets, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
