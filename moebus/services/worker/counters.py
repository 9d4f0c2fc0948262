"""The worker's request counters, kept in one place: its Prometheus counter
`moebus_worker_requests_total{outcome}`, which stats() reads back."""
from __future__ import annotations

from moebus.shared.metrics import Metrics

OUTCOMES = ("accepted", "finished", "aborted", "rejected_overloaded", "handed_back", "failed", "handed_off")
_LABELS = {"rejected_overloaded": "overloaded"}  # the metric's label value where it differs from the stats key


class RequestCounters:
    def __init__(self, metrics: Metrics) -> None:
        self._counter = metrics.counter("requests_total", "Requests by outcome", ["outcome"])
        self._series = {o: self._counter.labels(_LABELS.get(o, o)) for o in OUTCOMES}

    def inc(self, outcome: str) -> None:
        self._series[outcome].inc()

    def snapshot(self) -> dict[str, int]:
        """Every outcome's count so far (for stats())."""
        values = {s.labels["outcome"]: s.value for m in self._counter.collect() for s in m.samples
                  if s.name.endswith("_total")}
        return {o: int(values.get(_LABELS.get(o, o), 0)) for o in OUTCOMES}
