"""Per-second rates of a worker's demand, from the cumulative counters of its heartbeats' `Load`.

The planner (its pools' demand) and the frontend (`moebus status`, the fleet gauges) both read
them. Rates span the beats of the last `window_s` (at least two beats); a counter that goes down
(or a beat's clock that does) means a restarted process: its history starts over.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from .messages import Load


class Rates(NamedTuple):
    requests: float  # requests accepted per second
    prompt_tokens: float
    output_tokens: float


@dataclass(slots=True)
class LoadRates:
    window_s: float
    _samples: deque[tuple[float, int, int, int]] = field(default_factory=deque)  # (ts, requests, prompt, output)

    def add(self, ts: float, load: Load) -> None:
        """One beat's counters; ts: the beat's own clock (Heartbeat.ts)."""
        sample = (ts, load.requests_total, load.prompt_tokens_total, load.output_tokens_total)
        last = self._samples[-1] if self._samples else None
        if last is not None and (ts <= last[0] or any(a < b for a, b in zip(sample[1:], last[1:], strict=True))):
            self._samples.clear()
        self._samples.append(sample)
        while len(self._samples) > 2 and ts - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rates(self) -> Rates:
        if len(self._samples) < 2:
            return Rates(0.0, 0.0, 0.0)
        (t0, r0, p0, o0), (t1, r1, p1, o1) = self._samples[0], self._samples[-1]
        dt = t1 - t0
        return Rates((r1 - r0) / dt, (p1 - p0) / dt, (o1 - o0) / dt) if dt > 0 else Rates(0.0, 0.0, 0.0)
