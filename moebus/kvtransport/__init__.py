"""KV transports: move one KVPayload (moebus.engine.kv_transfer) between processes by transfer id.

Their own package because they need both the engine's payload (torch) and NATS: the engine
imports no NATS, and shared imports no torch. Services (worker, KV broker) use them.
"""
from moebus.kvtransport.base import KVTransferError, KVTransferTimeout, KVTransport
from moebus.kvtransport.nats import NatsKVTransport, NatsTransportConfig
from moebus.kvtransport.shm import ShmKVTransport, ShmTransportConfig

__all__ = ["KVTransferError", "KVTransferTimeout", "KVTransport", "NatsKVTransport", "NatsTransportConfig",
           "ShmKVTransport", "ShmTransportConfig"]
