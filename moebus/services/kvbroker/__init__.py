"""KV broker service: prefix-block index across workers, shared CPU/disk KV tiers.

Importing the package (config) stays torch-free; the service imports the KV code's torch side
(moebus.kv) on first use. Workers and balancers never import this package: they talk to the
broker through moebus.kv.broker_client (its index, PrefixIndex, is moebus.kv.index).
"""
from typing import Any

from .config import KVBrokerConfig, parse_bytes

__all__ = ["KVBrokerConfig", "KVBrokerService", "parse_bytes"]


def __getattr__(name: str) -> Any:
    if name == "KVBrokerService":
        from .service import KVBrokerService

        return KVBrokerService
    raise AttributeError(name)
