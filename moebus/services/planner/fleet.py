"""What the planner knows of the workers: their last heartbeats, turned into per-pool observations.

Rates come from the cumulative counters of each worker's beats within `rate_window_s`
(shared/load_rates.py); latency is the worst worker's recent p90.
Pure: the service feeds beats and the time in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moebus.shared.load_rates import LoadRates
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
    rates: LoadRates

    @property
    def pool(self) -> PoolName:
        role = self.beat.role or "both"
        return role if role in ("prefill", "decode") else "both"


class Fleet:
    def __init__(self, missed_heartbeats: int, rate_window_s: float) -> None:
        self.missed_heartbeats = missed_heartbeats
        self.rate_window_s = rate_window_s
        self._workers: dict[str, _Worker] = {}

    def observe(self, beat: Heartbeat, now: float) -> None:
        w = self._workers.get(beat.instance_id)
        if w is None:
            w = self._workers[beat.instance_id] = _Worker(beat, now, LoadRates(self.rate_window_s))
        w.beat, w.seen = beat, now
        if beat.load is not None:
            w.rates.add(beat.ts, beat.load)

    def silent(self, now: float, since: float = -math.inf) -> list[str]:
        """Workers that missed their heartbeats. since: silence before this does not count (the
        planner could not hear them: Bus.evidence_since; +inf: nobody is silent)."""
        return [i for i, w in self._workers.items()
                if now - max(w.seen, since) > self.missed_heartbeats * max(w.beat.interval_s, 1e-3)]

    def node(self, worker_id: str) -> str | None:
        """The bus node its last heartbeat named."""
        w = self._workers.get(worker_id)
        return w.beat.bus_node if w else None

    def seen(self, worker_id: str) -> float:
        """When its last heartbeat came (monotonic)."""
        w = self._workers.get(worker_id)
        return w.seen if w else -math.inf

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
            r, p, t = w.rates.rates()
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
