"""Process-stable chained block hashes: the names KV blocks travel under between processes.

`block_manager.chain_hash` uses Python's hash() of `(prev, tokens)`; for the first block `prev`
is None, whose hash is address-based on Python < 3.12, so engine-local hashes differ between
processes. Anything shared across workers, the broker or a restart (transfers, tiers, the
prefix index) is keyed by these blake2b hashes instead; the engine keeps its own for its cache.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Any

_MASK = (1 << 63) - 1  # fits a signed int64 everywhere (orjson, databases)


def kv_namespace(engine: Any) -> str:
    """Blocks are only interchangeable between engines with the same model, dtype, block size
    and cache layout; the namespace keys the first hash of every chain."""
    cfg = engine.config
    shapes = ",".join(f"{tuple(k.shape[1:])}/{tuple(v.shape[1:])}" for k, v in engine.runner.kv_caches)
    return f"{cfg.model}|{cfg.dtype}|{cfg.block_size}|{shapes}"


def stable_block_hashes(token_ids: list[int], block_size: int, namespace: str,
                        known: list[int] | None = None) -> list[int]:
    """Chained hash of every full block of `token_ids`. `known` (hashes of a prefix computed
    earlier) is extended in place and returned, so growing sequences hash incrementally."""
    hashes = known if known is not None else []
    key = hashlib.blake2b(namespace.encode(), digest_size=32).digest()
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        prev = hashes[-1].to_bytes(8, "little") if hashes else b"\0" * 8
        toks = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        digest = hashlib.blake2b(prev + toks, digest_size=8, key=key).digest()
        hashes.append(int.from_bytes(digest, "little") & _MASK)
    return hashes
