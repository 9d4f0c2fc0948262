"""The balancer's KV-aware routing policy (pure python): pick the worker that finishes a request's
prefill first.

cost(worker) = prompt tokens it still has to compute given its cached prefix
             + the cost of loading blocks it lacks from a shared tier (a fraction of computing them)
             + the work already queued or running there, in the same prefill-token units.
A worker whose queue is full is never chosen; one without room for the request's blocks pays a
penalty (it would have to preempt or wait).
"""
from __future__ import annotations

from dataclasses import dataclass

from moebus.shared.messages import BROKER_HOLDER, PrefixMatch


@dataclass(frozen=True, slots=True)
class WorkerState:
    worker_id: str
    cached_blocks: int = 0  # leading prompt blocks in its device prefix cache (broker query)
    tier_blocks: int = 0  # leading prompt blocks in its own host tiers (cpu/disk)
    num_running: int = 0
    num_waiting: int = 0
    max_waiting: int = 0  # 0: no admission limit
    queued_prefill_tokens: float | None = None  # queued work, when known better than by count
    kv_blocks_free: int | None = None


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    block_size: int = 16
    running_cost_tokens: float = 16.0  # a running sequence slows every step like this many prefill tokens
    waiting_cost_tokens: float = 256.0  # a queued request ahead (average uncached prompt)
    tier_load_cost: float = 0.1  # loading a block from a tier, relative to recomputing it
    no_room_penalty_tokens: float = 4096.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or not 0.0 <= self.tier_load_cost <= 1.0:
            raise ValueError("block_size must be >= 1 and tier_load_cost in [0, 1]")


def prefill_tokens(prompt_len: int, cached_tokens: int) -> int:
    """Tokens still to compute; the last prompt token always runs (its logits are sampled)."""
    return max(1, prompt_len - min(cached_tokens, prompt_len - 1))


def usable_tokens(prompt_len: int, w: WorkerState, block_size: int, shared_tier_blocks: int = 0) -> int:
    """Prompt tokens `w` need not compute: its cached prefix, or one it can load from a tier."""
    held = max(w.cached_blocks, w.tier_blocks, shared_tier_blocks) * block_size
    return min(held, prompt_len - 1)


def routing_cost(prompt_len: int, w: WorkerState, weights: RoutingWeights = RoutingWeights(),
                 shared_tier_blocks: int = 0) -> float:
    """shared_tier_blocks: leading prompt blocks the KV broker's tiers hold (any worker can load them)."""
    if w.max_waiting and w.num_waiting >= w.max_waiting:
        return float("inf")
    bs = weights.block_size
    local = w.cached_blocks * bs
    usable = usable_tokens(prompt_len, w, bs, shared_tier_blocks)
    compute = prefill_tokens(prompt_len, usable)
    load = max(0, usable - local) * weights.tier_load_cost
    queued = w.queued_prefill_tokens if w.queued_prefill_tokens is not None \
        else w.num_waiting * weights.waiting_cost_tokens
    cost = compute + load + queued + w.num_running * weights.running_cost_tokens
    if w.kv_blocks_free is not None:
        need = -(-prompt_len // bs) - w.cached_blocks
        if need > w.kv_blocks_free:
            cost += weights.no_room_penalty_tokens
    return cost


def rank_workers(prompt_len: int, workers: list[WorkerState], weights: RoutingWeights = RoutingWeights(),
                 shared_tier_blocks: int = 0) -> list[tuple[str, float]]:
    """(worker id, cost), cheapest first; ties go to the name order; full workers are left out."""
    costs = [(w.worker_id, routing_cost(prompt_len, w, weights, shared_tier_blocks)) for w in workers]
    return sorted(((i, c) for i, c in costs if c != float("inf")), key=lambda ic: (ic[1], ic[0]))


def choose_worker(prompt_len: int, workers: list[WorkerState], weights: RoutingWeights = RoutingWeights(),
                  shared_tier_blocks: int = 0) -> str | None:
    ranked = rank_workers(prompt_len, workers, weights, shared_tier_blocks)
    return ranked[0][0] if ranked else None


def overlaps(matches: list[PrefixMatch], broker_holder: str = BROKER_HOLDER) -> tuple[dict[str, int], dict[str, int], int]:
    """Split a PrefixQueryReply's matches into (device blocks per worker, host-tier blocks per
    worker, blocks in the broker's own tiers)."""
    device: dict[str, int] = {}
    tiers: dict[str, int] = {}
    shared = 0
    for m in matches:
        if m.holder == broker_holder:
            shared = max(shared, m.num_blocks)
        elif m.tier == "device":
            device[m.holder] = max(device.get(m.holder, 0), m.num_blocks)
        else:
            tiers[m.holder] = max(tiers.get(m.holder, 0), m.num_blocks)
    return device, tiers, shared
