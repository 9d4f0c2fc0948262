"""Prefill/decode disaggregation: KV payloads, engine extract/inject, and transports."""
from moebus.engine.kv_transfer.engine_io import (
    InjectResult,
    PrefillResult,
    extract_kv,
    gather_blocks,
    inject_prefilled,
    prefill,
    scatter_blocks,
    settled_tokens,
)
from moebus.engine.kv_transfer.hashing import kv_namespace, stable_block_hashes
from moebus.engine.kv_transfer.nats_transport import NatsKVTransport, NatsTransportConfig
from moebus.engine.kv_transfer.payload import KVBlock, KVPayload, LayerKV
from moebus.engine.kv_transfer.shm_transport import ShmKVTransport, ShmTransportConfig
from moebus.engine.kv_transfer.transport import KVTransferError, KVTransferTimeout, KVTransport

__all__ = [
    "InjectResult", "KVBlock", "KVPayload", "KVTransferError", "KVTransferTimeout", "KVTransport", "LayerKV",
    "NatsKVTransport", "NatsTransportConfig", "PrefillResult", "ShmKVTransport", "ShmTransportConfig",
    "extract_kv", "gather_blocks", "inject_prefilled", "kv_namespace", "prefill", "scatter_blocks",
    "settled_tokens", "stable_block_hashes",
]
