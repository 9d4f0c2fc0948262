"""KV broker service: prefix-block index across workers, shared CPU/disk KV tiers, KV-aware routing."""
from .config import KVBrokerConfig
from .index import PrefixIndex
from .routing import RoutingWeights, WorkerState, choose_worker, rank_workers, routing_cost
from .service import KVBrokerService

__all__ = ["KVBrokerConfig", "KVBrokerService", "PrefixIndex", "RoutingWeights", "WorkerState", "choose_worker",
           "rank_workers", "routing_cost"]
