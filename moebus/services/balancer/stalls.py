"""How long the balancer's own event loop was stalled, so a worker's silence excludes it.

A process starved of CPU, paused by a long GC or blocked by a slow callback cannot read the
heartbeats that arrive meanwhile; when it wakes, its reaper may run before the beats waiting in its
socket (or, when the worker shares the process, before the worker has even sent the overdue one)
are read. Silence during our own stall is no evidence against a worker, so it is not counted.
The reaper measures each stall as how late its timer fired; only the stalls after a worker's last
beat excuse that worker's silence, so a loop that is late on every round still reaps: it counts
its sleeps, not its lateness.
"""
from __future__ import annotations

from collections import deque


class LoopStalls:
    def __init__(self, horizon_s: float, min_lag_s: float = 0.0) -> None:
        """horizon_s: stalls older than this are forgotten (longer than any worker's allowance);
        min_lag_s: lateness below this is timer jitter, not a stall."""
        self.horizon_s = horizon_s
        self.min_lag_s = min_lag_s
        self._stalls: deque[tuple[float, float]] = deque()  # (woke at, seconds late), oldest first

    def record(self, due: float, woke: float) -> None:
        """A timer due at `due` fired at `woke` (monotonic seconds)."""
        lag = woke - due
        if lag > self.min_lag_s:
            self._stalls.append((woke, lag))
        while self._stalls and self._stalls[0][0] < woke - self.horizon_s:
            self._stalls.popleft()

    def since(self, t: float) -> float:
        """Seconds of stall that ended after monotonic time `t` (a stall that began before it counts
        only from it)."""
        return sum(min(lag, woke - t) for woke, lag in self._stalls if woke > t)
