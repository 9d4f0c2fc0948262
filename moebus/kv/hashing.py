"""Block names shared across processes: the engine's KV namespace, its KV fingerprint, and the
process-stable chained block hashes KV blocks travel under.

Torch-free, so the balancer hashes prompts with the same function the workers use. Keyed by the
workers' KV namespace (model, dtype, block size, cache layout), so blocks are only ever matched
between engines that can use each other's KV. Transfers, tiers and the broker's prefix index use
these blake2b hashes; an engine's own prefix cache keeps its cheaper in-process hashes.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NamedTuple, Protocol


class _Shaped(Protocol):
    @property
    def shape(self) -> Sequence[int]: ...


class _CacheConfig(Protocol):
    model: str
    dtype: str
    block_size: int


class NamespaceSource(Protocol):
    """What kv_namespace reads of an engine: its config and its cache tensors' shapes."""

    @property
    def config(self) -> _CacheConfig: ...

    @property
    def kv_caches(self) -> Sequence[Sequence[_Shaped]]: ...

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


class BlockHashes(NamedTuple):
    """A prompt's stable block hashes and the space they were computed in (hash_space)."""

    space: str
    hashes: list[int]


class HashedRequest(Protocol):
    """An engine request as its stable hashes see it (engine/request.py:Request)."""

    @property
    def hash_token_ids(self) -> list[int]: ...

    stable_hashes: list[int]
    stable_space: str


def request_block_hashes(req: HashedRequest, n_blocks: int, block_size: int, namespace: str) -> list[int]:
    """The first n_blocks stable hashes of an engine request, for every KV consumer of the engine
    (cache events, transfer, tiers): the request keeps them (seeded with the frontend's hashes of
    its prompt where they are of this space) and they are extended in place as its blocks fill, so
    each block of a request is hashed once. A request hashed in another space is hashed afresh."""
    space = hash_space(namespace, block_size)
    tokens = req.hash_token_ids[: n_blocks * block_size]
    if req.stable_space and req.stable_space != space:
        return stable_block_hashes(tokens, block_size, namespace)
    req.stable_space = space
    return stable_block_hashes(tokens, block_size, namespace, req.stable_hashes)[:n_blocks]


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


def kv_namespace(engine: NamespaceSource) -> str:
    """Blocks are only interchangeable between engines with the same model, dtype, block size
    and cache layout; the namespace keys the first hash of every chain."""
    cfg = engine.config
    # a layer's cache is (k, v, *planes): DeepSeek-V4's compressed layers add compressor planes
    shapes = ",".join("/".join(str(tuple(t.shape[1:])) for t in layer) for layer in engine.kv_caches)
    return f"{cfg.model}|{cfg.dtype}|{cfg.block_size}|{shapes}"


def kv_fingerprint(namespace: str) -> int:
    """The model and cache layout a block was made for (kv_namespace), as 63 bits; 0 for no
    namespace (unknown: not checked)."""
    if not namespace:
        return 0
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little") >> 1 or 1
