"""Moving blocks between an engine's paged KV cache and a TieredKVStore.

load_prefix fills the engine's prefix cache from the store before a waiting request is
scheduled, so the scheduler's ordinary `match_prefix` turns tier hits into cache hits;
KVOffloader copies newly computed full blocks of live requests into the store. Both run on the
engine thread between steps and use only public verbs of the engine, its scheduler and its block
manager (LLMEngine.kv, the KV connector, wraps them for a worker). A block is every tensor of
every layer's cache tuple (k, v, *planes), so DeepSeek-V4's compressor state travels with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moebus.engine.kv_tiers.store import TieredKVStore
from moebus.engine.kv_transfer.engine_io import gather_blocks, kv_block_ids, lookup, scatter_blocks
from moebus.engine.kv_transfer.hashing import kv_namespace, stable_block_hashes
from moebus.engine.kv_transfer.payload import KVBlock, stack_blocks
from moebus.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from moebus.engine.llm_engine import LLMEngine


def load_prefix(engine: LLMEngine, request: str | Request, store: TieredKVStore,
                namespace: str | None = None) -> int:
    """Load the blocks beyond the local prefix-cache hit that the store holds; returns how many
    prompt tokens are now cached. Call after add_request, before the step that admits it."""
    req = lookup(engine, request)
    bm, bs = engine.block_manager, engine.block_manager.block_size
    if not bm.enable_prefix_caching or req.status is not RequestStatus.WAITING or req.num_computed_tokens:
        return 0
    local = bm.full_block_hashes(req)
    hits = bm.cached_prefix(local)
    n_local = len(hits)
    max_blocks = (req.num_tokens - 1) // bs  # the last token always runs, as in match_prefix
    if n_local >= max_blocks:
        return n_local * bs
    stable = stable_block_hashes(req.hash_token_ids[: max_blocks * bs], bs, namespace or kv_namespace(engine))
    want = stable[n_local:max_blocks]
    want = want[: store.longest_prefix(want)]
    want = want[: max(0, bm.num_free_blocks - bm.num_free_of(hits))]  # never evict the hit we extend
    blocks = store.get_prefix(want)
    if not blocks:
        return n_local * bs
    # A stand-in request owns the new blocks while they are filled, then releases them as cached
    # free blocks: exactly the state a finished request leaves behind.
    n = (n_local + len(blocks)) * bs
    carrier = Request(f"{req.request_id}#kv-load", req.all_token_ids[:n], req.params)
    bm.allocate(carrier, n, hits)
    scatter_blocks(engine.kv_caches, kv_block_ids(carrier)[n_local:], stack_blocks(blocks))
    carrier.num_computed_tokens = n
    bm.cache_blocks(carrier)
    bm.free_request(carrier)
    return n


@dataclass(slots=True)
class _Progress:
    hashes: list[int] = field(default_factory=list)  # stable hashes of the request's full blocks
    done: int = 0  # blocks already offered to the store


class KVOffloader:
    """Keeps per-request progress so each full block is copied once; call offload(engine) after
    steps (every step, or every few): it returns the stable hashes it newly stored."""

    def __init__(self, store: TieredKVStore, namespace: str | None = None) -> None:
        self.store = store
        self.namespace = namespace
        self._progress: dict[str, _Progress] = {}

    def offload(self, engine: LLMEngine) -> list[int]:
        bs = engine.block_manager.block_size
        ns = self.namespace or kv_namespace(engine)
        live = engine.scheduler.holding_kv()
        todo: dict[int, int] = {}  # stable hash -> block id
        for req in live:
            prog = self._progress.setdefault(req.request_id, _Progress())
            block_ids = kv_block_ids(req)
            n_full = min(engine.settled_tokens(req) // bs, len(block_ids))
            if n_full <= prog.done:
                continue
            stable_block_hashes(req.hash_token_ids[: n_full * bs], bs, ns, prog.hashes)
            for i in range(prog.done, n_full):
                if prog.hashes[i] not in self.store:
                    todo.setdefault(prog.hashes[i], block_ids[i])
            prog.done = n_full
        alive = {r.request_id for r in live}
        for rid in [r for r in self._progress if r not in alive]:
            del self._progress[rid]
        if not todo:
            return []
        layers = gather_blocks(engine.kv_caches, list(todo.values()))  # one copy per cache tensor
        for j, h in enumerate(todo):
            self.store.put(h, KVBlock([tuple(t[j] for t in kv) for kv in layers]))
        return list(todo)


def offload(engine: LLMEngine, store: TieredKVStore, namespace: str | None = None) -> list[int]:
    """One-shot offload of every live request's full computed blocks the store lacks."""
    return KVOffloader(store, namespace).offload(engine)
