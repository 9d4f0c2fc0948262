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
    # a layer's cache is (k, v, *planes): DeepSeek-V4's compressed layers add compressor planes
    shapes = ",".join("/".join(str(tuple(t.shape[1:])) for t in layer) for layer in engine.kv_caches)
    return f"{cfg.model}|{cfg.dtype}|{cfg.block_size}|{shapes}"
