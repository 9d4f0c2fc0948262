"""Prefill/decode disaggregation: KV payloads and engine extract/inject (transports: moebus.kvtransport)."""
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
from moebus.engine.kv_transfer.payload import KVBlock, KVPayload, LayerKV, block_size_of

__all__ = [
    "InjectResult", "KVBlock", "KVPayload", "LayerKV",
    "PrefillResult", "block_size_of",
    "extract_kv", "gather_blocks", "inject_prefilled", "kv_namespace", "prefill", "scatter_blocks",
    "settled_tokens", "stable_block_hashes",
]
