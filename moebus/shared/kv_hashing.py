"""Process-stable chained block hashes: the names KV blocks travel under between processes.

Torch-free, so the balancer hashes prompts with the same function the workers use. Keyed by the
workers' KV namespace (model, dtype, block size, cache layout), so blocks are only ever matched
between engines that can use each other's KV. Transfers, tiers and the broker's prefix index use
these blake2b hashes; an engine's own prefix cache keeps its cheaper in-process hashes.
"""
from __future__ import annotations

import hashlib
from array import array

_MASK = (1 << 63) - 1  # fits a signed int64 everywhere (orjson, databases)


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


def hash_space(namespace: str, block_size: int) -> str:
    """The name of one way of hashing prompts into blocks: carried beside hashes computed in it."""
    return f"{namespace}/{block_size}"


def prompt_block_hashes(token_ids: list[int], block_size: int, namespace: str, carried: list[int],
                        carried_space: str) -> list[int]:
    """A request's block hashes in (namespace, block_size): those it carries when they were
    computed in that space (the frontend hashes each prompt once), else computed here."""
    if carried_space == hash_space(namespace, block_size):
        return carried
    return stable_block_hashes(token_ids, block_size, namespace)


def mm_hash_view(token_ids: list[int], images: list[tuple[int, int, int]]) -> list[int]:
    """`token_ids` with each image's placeholders (offset, length, content hash) replaced by the
    negated hash, so block hashes over the result tell different images apart (chaining carries it
    to every later block). Token ids are >= 0, so a negated hash never equals a real token."""
    if not images:
        return token_ids
    out = list(token_ids)
    for offset, length, content_hash in images:
        out[offset:offset + length] = [-1 - (content_hash & _MASK)] * length
    return out
