"""Moved to moebus.shared.kv_routing (pure python, used by the balancer)."""
from moebus.shared.kv_routing import (
    RoutingWeights,
    WorkerState,
    choose_worker,
    overlaps,
    prefill_tokens,
    rank_workers,
    routing_cost,
)

__all__ = ["RoutingWeights", "WorkerState", "choose_worker", "overlaps", "prefill_tokens", "rank_workers",
           "routing_cost"]
