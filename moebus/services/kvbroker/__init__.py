"""KV broker service: prefix-block index across workers, shared CPU/disk KV tiers.

Importing the package (config) stays torch-free; the service imports the KV code's torch side
(moebus.kv) on first use. Workers and balancers never import this package: they talk to the
broker through its KV events and moebus.kv.broker_client; each balancer keeps its own copy of
the index (moebus.kv.index.PrefixIndex), fed by the same events.
"""
from typing import Any

from .config import KVBrokerConfig, parse_bytes

__all__ = ["KVBrokerConfig", "KVBrokerService", "parse_bytes"]


def __getattr__(name: str) -> Any:
    if name == "KVBrokerService":
        from .service import KVBrokerService

        return KVBrokerService
    raise AttributeError(name)
