"""KV-cache tiers below the device cache: host memory and disk, and the engine hooks to use them."""
from moebus.engine.kv_tiers.base import Evicted, Tier
from moebus.engine.kv_tiers.cpu import CpuTier
from moebus.engine.kv_tiers.disk import DiskTier
from moebus.engine.kv_tiers.engine_io import KVOffloader, load_prefix, offload
from moebus.engine.kv_tiers.events import CacheEventTracker
from moebus.engine.kv_tiers.store import TieredKVStore

__all__ = ["CacheEventTracker", "CpuTier", "DiskTier", "Evicted", "KVOffloader", "Tier", "TieredKVStore",
           "load_prefix", "offload"]
