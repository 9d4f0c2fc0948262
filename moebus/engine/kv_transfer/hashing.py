"""Block names shared across processes: the engine's KV namespace, and the stable chained
hashes of moebus.shared.kv_hashing (one implementation for workers and the torch-free balancer)."""
from __future__ import annotations

from typing import Any

from moebus.shared.kv_hashing import stable_block_hashes

__all__ = ["kv_namespace", "stable_block_hashes"]


def kv_namespace(engine: Any) -> str:
    """Blocks are only interchangeable between engines with the same model, dtype, block size
    and cache layout; the namespace keys the first hash of every chain."""
    cfg = engine.config
    shapes = ",".join(f"{tuple(k.shape[1:])}/{tuple(v.shape[1:])}" for k, v in engine.kv_caches)
    return f"{cfg.model}|{cfg.dtype}|{cfg.block_size}|{shapes}"
