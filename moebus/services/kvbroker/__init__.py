"""KV broker service: prefix-block index across workers, shared CPU/disk KV tiers.

Importing the package (config, index) stays torch-free; the service imports the engine's KV
code (and torch) on first use. Workers and balancers never import this package: they talk to
the broker through moebus.shared.kv_client.
"""
from typing import Any

from moebus.kv.index import PrefixIndex

from .config import KVBrokerConfig, parse_bytes

__all__ = ["KVBrokerConfig", "KVBrokerService", "PrefixIndex", "parse_bytes"]


def __getattr__(name: str) -> Any:
    if name == "KVBrokerService":
        from .service import KVBrokerService

        return KVBrokerService
    raise AttributeError(name)
