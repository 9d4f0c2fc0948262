"""Per-replica capacity, learned online from throughput observed at known latency.

A replica that served `x` work tokens/s while the SLO held can do at least `x`; one that broke the
SLO at `x` can do at most `x`. The estimate moves toward such bounds when it is on their wrong
side, so it settles near the throughput at which latency reaches the SLO.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Capacity:
    prior: float  # work tokens/s per replica before anything is learned
    alpha: float  # learning rate
    floor: float  # never below prior x floor: one bad tick must not ask for the whole fleet
    value: float = 0.0

    def __post_init__(self) -> None:
        self.value = self.prior

    def observe(self, per_replica: float, slo_violated: bool) -> None:
        """`per_replica`: work tokens/s one replica served this tick (0: nothing to learn from)."""
        if per_replica <= 0:
            return
        if slo_violated and per_replica < self.value:  # an upper bound below the estimate
            self.value += self.alpha * (per_replica - self.value)
        elif not slo_violated and per_replica > self.value:  # a lower bound above it
            self.value += self.alpha * (per_replica - self.value)
        self.value = max(self.value, self.prior * self.floor)
