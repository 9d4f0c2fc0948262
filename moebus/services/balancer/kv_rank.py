"""KV-aware ordering of candidate workers: ask the KV broker's index which workers hold the
prompt's leading blocks and rank by the estimated time to finish its prefill (kv_routing.py).

No broker (or no KV info in the heartbeats: toy workers) -> the plain least-loaded order. After
a failed query the broker is left alone for a while so a dead broker costs routes nothing.
Each route's decision is counted by reason in `moebus_balancer_route_decisions_total{reason}`
(REASONS); the balancer's bus carries its Metrics.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from moebus.kv.broker_client import KVBrokerClient
from moebus.kv.hashing import stable_block_hashes
from moebus.shared.bus import Bus
from moebus.shared.messages import BROKER_HOLDER
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import annotate

from .kv_routing import RoutingWeights, WorkerState, overlaps, prefill_tokens, rank_workers, usable_tokens
from .table import WorkerEntry

# prefix_hit: some worker (or the broker's tiers) held the prompt's leading blocks; no_prefix:
# asked, none did; index_unavailable: the broker did not answer (or is being left alone);
# load_only: nothing to ask about (one candidate, or no KV info in the heartbeats).
REASONS = ("prefix_hit", "no_prefix", "index_unavailable", "load_only")


@dataclass(slots=True)
class Ranking:
    entries: list[WorkerEntry]  # best first
    # Worker id -> prompt tokens it would compute (its cached prefix taken off); what a pick there
    # counts as pending load until the worker's next heartbeat. Empty: not ranked by KV.
    prefill_tokens: dict[str, float] = field(default_factory=dict)


class KVRanker:
    def __init__(self, bus: Bus, subjects: Subjects, timeout_s: float = 0.25, backoff_s: float = 2.0) -> None:
        self.index = KVBrokerClient(bus, "balancer", subjects, timeout_s)
        self.backoff_s = backoff_s
        self._quiet_until = 0.0
        self.queries = 0
        self.hits = 0  # routes where some worker held a prefix of the prompt
        metrics = bus.metrics
        counter = metrics.counter("route_decisions_total", "KV-aware routes by how they were decided",
                                  ["reason"]) if metrics else None
        self._decided = {r: counter.labels(r) for r in REASONS} if counter else {}

    def _decide(self, reason: str) -> None:
        annotate({"moebus.route.reason": reason})  # the route span's why
        if self._decided:
            self._decided[reason].inc()

    async def order(self, prompt: list[int], entries: list[WorkerEntry]) -> Ranking:
        kv = next((e.beat.kv for e in entries if e.beat.kv is not None), None)
        if kv is None or len(entries) < 2:
            self._decide("load_only")
            return Ranking(entries)
        matches = None
        hashes = stable_block_hashes(prompt, kv.block_size, kv.namespace)
        reason = "no_prefix" if not hashes else "index_unavailable"  # unless asked and answered
        if hashes and time.monotonic() >= self._quiet_until:
            self.queries += 1
            matches = await self.index.query(hashes, holders=[e.worker_id for e in entries] + [BROKER_HOLDER])
            if matches is None:
                self._quiet_until = time.monotonic() + self.backoff_s
            else:
                reason = "no_prefix"
        device, tiers, shared = overlaps(matches or [])
        self.hits += bool(device or tiers)
        self._decide("prefix_hit" if device or tiers else reason)
        weights = RoutingWeights(kv.block_size)
        states = [_state(e, device, tiers, weights) for e in entries]
        ranked = dict(rank_workers(len(prompt), states, weights, shared))
        # Equal cost: fewest past picks first (round robin); full workers last (stale numbers).
        order = sorted(entries, key=lambda e: (e.worker_id not in ranked, ranked.get(e.worker_id, 0.0),
                                               e.assigned_total, e.worker_id))
        n = len(prompt)
        return Ranking(order, {s.worker_id: float(prefill_tokens(n, usable_tokens(n, s, kv.block_size, shared)))
                               for s in states})


def _state(e: WorkerEntry, device: dict[str, int], tiers: dict[str, int], weights: RoutingWeights) -> WorkerState:
    """Queued work in prefill tokens: the waiting requests the last heartbeat reported at the
    average prompt's cost, plus what was picked here since, at its own estimate (table.py)."""
    load = e.beat.load
    waiting = load.num_waiting if load else 0
    return WorkerState(e.worker_id, cached_blocks=device.get(e.worker_id, 0), tier_blocks=tiers.get(e.worker_id, 0),
                       num_running=load.num_running if load else 0, num_waiting=e.queued,
                       max_waiting=load.max_waiting if load else 0,
                       queued_prefill_tokens=waiting * weights.waiting_cost_tokens + e.pending_tokens,
                       kv_blocks_free=load.kv_blocks_free if load and load.kv_blocks_total else None)
