"""KV-aware ordering of candidate workers from the balancer's own prefix index: which workers (and
the KV broker's shared tiers) hold the prompt's leading blocks, ranked by the estimated time to
finish its prefill (kv_routing.py).

The index is fed by the KV events every holder publishes (each balancer replica hears them all,
as the broker does), so a route asks nobody: no nested request while the balancer holds one. The
prompt's block hashes come with the request (the frontend hashed it once) unless it was hashed in
another space. No KV info in the heartbeats (toy workers) -> the plain least-loaded order. Each
route's decision is counted by reason in `moebus_balancer_route_decisions_total{reason}` (REASONS).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moebus.kv.index import PrefixIndex
from moebus.shared.messages import BROKER_HOLDER, GenerateRequest
from moebus.shared.metrics import Metrics
from moebus.shared.tracing import annotate

from .kv_routing import RoutingWeights, WorkerState, overlaps, prefill_tokens, rank_workers, usable_tokens
from .table import WorkerEntry

# prefix_hit: some worker (or the broker's tiers) held the prompt's leading blocks; no_prefix: none
# did; index_unavailable: no candidate has reported its cache yet (a fresh balancer, or workers
# without KV events); load_only: nothing to rank by KV (one candidate, or no KV info in the beats).
REASONS = ("prefix_hit", "no_prefix", "index_unavailable", "load_only")


@dataclass(slots=True)
class Ranking:
    entries: list[WorkerEntry]  # best first
    # Worker id -> prompt tokens it would compute (its cached prefix taken off); what a pick there
    # counts as pending load until the worker's next heartbeat. Empty: not ranked by KV.
    prefill_tokens: dict[str, float] = field(default_factory=dict)


class KVRanker:
    def __init__(self, index: PrefixIndex, metrics: Metrics | None = None) -> None:
        self.index = index
        self.queries = 0
        self.hits = 0  # routes where some worker held a prefix of the prompt
        counter = metrics.counter("route_decisions_total", "KV-aware routes by how they were decided",
                                  ["reason"]) if metrics else None
        self._decided = {r: counter.labels(r) for r in REASONS} if counter else {}

    def _decide(self, reason: str) -> None:
        annotate({"moebus.route.reason": reason})  # the route span's why
        if self._decided:
            self._decided[reason].inc()

    def order(self, req: GenerateRequest, entries: list[WorkerEntry]) -> Ranking:
        kv = next((e.beat.kv for e in entries if e.beat.kv is not None), None)
        if kv is None or len(entries) < 2:
            self._decide("load_only")
            return Ranking(entries)
        hashes = req.block_hashes_in(kv.block_size, kv.namespace)
        holders = {e.worker_id for e in entries}
        matches = []
        if hashes:
            self.queries += 1
            matches = self.index.longest_prefix(hashes, holders | {BROKER_HOLDER})
        device, tiers, shared = overlaps(matches)
        self.hits += bool(device or tiers)
        if device or tiers or shared:
            self._decide("prefix_hit" if device or tiers else "no_prefix")
        else:
            self._decide("no_prefix" if not hashes or self.index.knows_any(holders) else "index_unavailable")
        weights = RoutingWeights(kv.block_size)
        states = [_state(e, device, tiers, weights) for e in entries]
        n = len(req.prompt_token_ids)
        ranked = dict(rank_workers(n, states, weights, shared))
        # Equal cost: fewest past picks first (round robin); full workers last (stale numbers).
        order = sorted(entries, key=lambda e: (e.worker_id not in ranked, ranked.get(e.worker_id, 0.0),
                                               e.assigned_total, e.worker_id))
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
