"""Demand forecast: Holt's linear smoothing (level + trend per second) over irregular samples."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Holt:
    alpha: float  # weight of a new sample in the level
    beta: float  # weight of a new slope in the trend
    level: float | None = None
    trend: float = 0.0  # units per second
    t: float = 0.0

    def update(self, value: float, now: float) -> None:
        if self.level is None:
            self.level, self.t = value, now
            return
        dt = max(now - self.t, 1e-6)
        prior = self.level + self.trend * dt
        level = self.alpha * value + (1 - self.alpha) * prior
        self.trend = self.beta * (level - self.level) / dt + (1 - self.beta) * self.trend
        self.level, self.t = level, now

    def predict(self, ahead_s: float) -> float:
        """The expected value `ahead_s` from the last sample (never negative)."""
        if self.level is None:
            return 0.0
        return max(0.0, self.level + self.trend * ahead_s)
