"""Process-stable chained block hashes, torch-free (the balancer hashes prompts with it).

The same algorithm as engine.kv_transfer.hashing.stable_block_hashes (a test keeps the two
equal); duplicated because shared/ must not import the engine (and so torch).
"""
from __future__ import annotations

import hashlib
from array import array

_MASK = (1 << 63) - 1


def stable_block_hashes(token_ids: list[int], block_size: int, namespace: str) -> list[int]:
    """Chained blake2b hash of every full block, keyed by the workers' KV namespace."""
    hashes: list[int] = []
    key = hashlib.blake2b(namespace.encode(), digest_size=32).digest()
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        prev = hashes[-1].to_bytes(8, "little") if hashes else b"\0" * 8
        toks = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        digest = hashlib.blake2b(prev + toks, digest_size=8, key=key).digest()
        hashes.append(int.from_bytes(digest, "little") & _MASK)
    return hashes
