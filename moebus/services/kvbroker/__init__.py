"""KV broker service: prefix-block index across workers, shared CPU/disk KV tiers, KV-aware routing.

Importing the package, its index, routing and index client stays torch-free (balancers use
them); the service and the tier client import the engine's KV code (and torch) on first use.
"""
from typing import Any

from moebus.shared.kv_index_client import BrokerUnavailable, KVIndexClient
from moebus.shared.kv_routing import (
    RoutingWeights,
    WorkerState,
    choose_worker,
    overlaps,
    rank_workers,
    routing_cost,
)

from .config import KVBrokerConfig
from .index import PrefixIndex

__all__ = ["BrokerUnavailable", "KVBrokerClient", "KVBrokerConfig", "KVBrokerService", "KVIndexClient",
           "PrefixIndex", "RoutingWeights", "WorkerState", "choose_worker", "overlaps", "rank_workers",
           "routing_cost"]


def __getattr__(name: str) -> Any:
    if name == "KVBrokerService":
        from .service import KVBrokerService

        return KVBrokerService
    if name == "KVBrokerClient":
        from .tier_client import KVBrokerClient

        return KVBrokerClient
    raise AttributeError(name)
