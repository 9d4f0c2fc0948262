"""What the planner knows of the workers: their last heartbeats, turned into per-pool observations.

Rates come from the cumulative counters of each worker's beats within `rate_window_s` (a counter
that goes down means a restart: its history starts over); latency is the worst worker's recent p90.
Pure: the service feeds beats and the time in.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from moebus.shared.messages import Heartbeat, Load
from moebus.shared.messages.planner import PoolName, PoolObservation


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the actuators see it."""

    worker_id: str
    pool: PoolName
    ready: bool
    draining: bool
    inflight: int  # running + waiting


@dataclass(slots=True)
class _Worker:
    beat: Heartbeat
    seen: float  # monotonic time of the last beat
    counters: deque[tuple[float, int, int, int]] = field(default_factory=deque)  # (ts, requests, prompt, output)

    @property
    def pool(self) -> PoolName:
        role = self.beat.role or "both"
        return role if role in ("prefill", "decode") else "both"

    def rates(self) -> tuple[float, float, float]:
        if len(self.counters) < 2:
            return 0.0, 0.0, 0.0
        (t0, r0, p0, o0), (t1, r1, p1, o1) = self.counters[0], self.counters[-1]
        dt = t1 - t0
        return ((r1 - r0) / dt, (p1 - p0) / dt, (o1 - o0) / dt) if dt > 0 else (0.0, 0.0, 0.0)


class Fleet:
    def __init__(self, missed_heartbeats: int, rate_window_s: float) -> None:
        self.missed_heartbeats = missed_heartbeats
        self.rate_window_s = rate_window_s
        self._workers: dict[str, _Worker] = {}

    def observe(self, beat: Heartbeat, now: float) -> None:
        w = self._workers.get(beat.instance_id)
        if w is None:
            w = self._workers[beat.instance_id] = _Worker(beat, now)
        w.beat, w.seen = beat, now
        if beat.load is None:
            return
        sample = (beat.ts, beat.load.requests_total, beat.load.prompt_tokens_total, beat.load.output_tokens_total)
        if w.counters and (sample[0] <= w.counters[-1][0] or any(a < b for a, b in zip(sample[1:], w.counters[-1][1:],
                                                                                        strict=True))):
            w.counters.clear()  # a restarted worker (or a clock step): rates start over
        w.counters.append(sample)
        while len(w.counters) > 2 and sample[0] - w.counters[1][0] >= self.rate_window_s:
            w.counters.popleft()

    def silent(self, now: float, since: float = -math.inf) -> list[str]:
        """Workers that missed their heartbeats. since: silence before this does not count (the
        planner could not hear them: Bus.evidence_since; +inf: nobody is silent)."""
        return [i for i, w in self._workers.items()
                if now - max(w.seen, since) > self.missed_heartbeats * max(w.beat.interval_s, 1e-3)]

    def forget(self, worker_ids: list[str]) -> None:
        for i in worker_ids:
            self._workers.pop(i, None)

    def expire(self, now: float, since: float = -math.inf) -> list[str]:
        """Forget the silent workers; returns their ids."""
        gone = self.silent(now, since)
        self.forget(gone)
        return gone

    def workers(self) -> list[WorkerView]:
        return [WorkerView(i, w.pool, w.beat.ready, w.beat.draining,
                           (w.beat.load.num_running + w.beat.load.num_waiting) if w.beat.load else 0)
                for i, w in sorted(self._workers.items())]

    def observations(self) -> dict[PoolName, PoolObservation]:
        out: dict[PoolName, PoolObservation] = {}
        kv: dict[PoolName, list[float]] = {}
        for w in self._workers.values():
            o = out.setdefault(w.pool, PoolObservation())
            load = w.beat.load or Load()
            if w.beat.draining:
                o.draining += 1
            elif w.beat.ready:
                o.replicas += 1
            else:
                o.starting += 1
            o.num_running += load.num_running
            o.num_waiting += load.num_waiting
            if load.kv_blocks_total > 0:
                kv.setdefault(w.pool, []).append(1 - load.kv_blocks_free / load.kv_blocks_total)
            # Draining workers' demand is real: it moves to the others.
            r, p, t = w.rates()
            o.request_rate += r
            o.prompt_tokens_rate += p
            o.output_tokens_rate += t
            o.ttft_p90_s = _worst(o.ttft_p90_s, load.ttft_p90_s)
            o.itl_p90_s = _worst(o.itl_p90_s, load.itl_p90_s)
        for pool, usage in kv.items():
            out[pool].kv_usage = sum(usage) / len(usage)
        return out


def _worst(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
