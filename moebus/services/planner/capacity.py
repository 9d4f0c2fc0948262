"""Per-replica capacity, learned online from throughput observed at known latency.

A replica that served `x` work tokens/s while the SLO held can do at least `x`; one that broke the
SLO can do at most the most it served while that latency was measured: the workers' latency
percentiles cover `window_s` (their `latency_window_s`), so a breach seen now may be from a busier
moment of that window, and bounding by the current rate alone would ratchet the estimate down
while load falls. The estimate moves toward such bounds when it is on their wrong side, so it
settles near the throughput at which latency reaches the SLO.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class Capacity:
    prior: float  # work tokens/s per replica before anything is learned
    alpha: float  # learning rate
    floor: float  # never below prior x floor: one bad tick must not ask for the whole fleet
    window_s: float = 30.0  # how far back a latency breach may reach (the workers' latency window)
    value: float = 0.0
    _recent: deque[tuple[float, float]] = field(default_factory=deque)  # (when, per-replica throughput)

    def __post_init__(self) -> None:
        self.value = self.prior

    def observe(self, per_replica: float, slo_violated: bool, now: float = 0.0) -> None:
        """`per_replica`: work tokens/s one replica served this tick (0: nothing to learn from)."""
        self._recent.append((now, per_replica))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        if per_replica <= 0:
            return
        bound = max(x for _, x in self._recent)
        if slo_violated and bound < self.value:  # an upper bound below the estimate
            self.value += self.alpha * (bound - self.value)
        elif not slo_violated and per_replica > self.value:  # a lower bound above it
            self.value += self.alpha * (per_replica - self.value)
        self.value = max(self.value, self.prior * self.floor)
