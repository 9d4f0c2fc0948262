"""Moved to moebus.shared.kv_index_client (torch-free, used by balancers and workers)."""
from moebus.shared.kv_index_client import BrokerUnavailable, KVIndexClient

__all__ = ["BrokerUnavailable", "KVIndexClient"]
