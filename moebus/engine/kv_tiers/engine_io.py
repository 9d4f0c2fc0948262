"""Moving blocks between an engine's paged KV cache and a TieredKVStore.

load_prefix fills the engine's prefix cache from the store before a waiting request is
scheduled, so the scheduler's ordinary `match_prefix` turns tier hits into cache hits;
KVOffloader copies newly computed full blocks of live requests into the store. Both run on the
engine thread between steps and use only public verbs of the engine, its scheduler and its block
manager (LLMEngine.kv, the KV connector, wraps them for a worker). A block is every tensor of
every layer's cache tuple (k, v, *planes), so DeepSeek-V4's compressor state travels with it.

With bounded sliding windows (engine.kv_groups) a block's windowed parts are offloaded while the
request still holds them (else the block goes with its full parts only, the window part as 0
rows), and a prefix is restored only as far as its window tail is there (in the tier or the
engine's window pool); a shorter one otherwise, whose tokens after it are recomputed.

Blocks are made under their stable hash and the engine's KV fingerprint (payload.KVBlock), and
read back asking for both: a tier block of another key, model or cache layout is dropped there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from moebus.engine.kv_groups import WINDOW
from moebus.engine.kv_tiers.store import TieredKVStore
from moebus.engine.kv_transfer.engine_io import (
    gather_blocks,
    gather_grouped,
    kv_block_ids,
    kv_groups,
    lookup,
    scatter_blocks,
    scatter_grouped,
)
from moebus.engine.kv_transfer.hashing import kv_namespace, stable_block_hashes
from moebus.engine.kv_transfer.payload import (
    WINDOWED,
    Groups,
    KVBlock,
    LayerKV,
    kv_fingerprint,
    missing_part,
    stack_blocks,
)
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
    ns = namespace or kv_namespace(engine)
    stable = stable_block_hashes(req.hash_token_ids[: max_blocks * bs], bs, ns)
    want = stable[n_local:max_blocks]
    want = want[: store.longest_prefix(want)]
    want = want[: max(0, bm.num_free_blocks - bm.num_free_of(hits))]  # never evict the hit we extend
    blocks = store.get_prefix(want, kv_fingerprint(ns))
    groups = kv_groups(engine)
    if groups is not None:
        blocks = _with_window_tail(engine, req, n_local, blocks, groups)
    else:  # one pool: every part of every block (a bounded engine's tier block may lack its window part)
        caches = engine.kv_caches
        whole = [all(t.shape == c.shape[1:] for kv, ckv in zip(b.layers, caches, strict=True)
                     for t, c in zip(kv, ckv, strict=True)) for b in blocks]
        blocks = blocks[: whole.index(False) if False in whole else len(blocks)]
    if not blocks:
        return n_local * bs
    # A stand-in request owns the new blocks while they are filled, then releases them as cached
    # free blocks: exactly the state a finished request leaves behind.
    n = (n_local + len(blocks)) * bs
    carrier = Request(f"{req.request_id}#kv-load", req.all_token_ids[:n], req.params)
    if groups is None:
        bm.allocate(carrier, n, hits)
        scatter_blocks(engine.kv_caches, kv_block_ids(carrier)[n_local:], stack_blocks(blocks))
    else:
        bm.full_block_hashes(carrier)
        carrier.num_computed_tokens = n  # the window is reserved from token n on (engine.window_blocks)
        if not bm.can_allocate(carrier, n, hits):
            return n_local * bs
        bm.allocate(carrier, n, hits)
        first = max(bm.first_live(n), n_local)  # window blocks before it: passed, or the local hit's
        scatter_grouped(engine.kv_caches, groups, kv_block_ids(carrier)[n_local:],
                        kv_block_ids(carrier, WINDOW)[first:], _stack(blocks, groups, first - n_local))
    carrier.num_computed_tokens = n
    bm.cache_blocks(carrier)
    bm.free_request(carrier)
    return n


def _with_window_tail(engine: LLMEngine, req: Request, n_local: int, blocks: list[KVBlock],
                      groups: Groups) -> list[KVBlock]:
    """The longest leading run of `blocks` (after n_local local hits) whose window tail is there:
    in the blocks themselves, or for a local hit's blocks in the engine's window pool."""
    bm, bs = engine.block_manager, engine.block_manager.block_size
    m = len(blocks)
    while m:
        lo = bm.first_live((n_local + m) * bs)
        if all(b.has_window(groups) for b in blocks[max(0, lo - n_local): m]) and (
                lo >= n_local or bm.window_cached(req.block_hashes, lo, n_local) is not None):
            break
        m -= 1
    return blocks[:m]


def _stack(blocks: list[KVBlock], groups: Groups, window_from: int) -> LayerKV:
    """Per layer, each tensor's blocks stacked: the windowed ones from blocks[window_from] on."""
    return [tuple(torch.stack([b.layers[i][j] for b in (blocks[window_from:] if g == WINDOWED else blocks)])
                  if g != WINDOWED or window_from < len(blocks) else kv[j].new_empty((0, *kv[j].shape))
                  for j, g in enumerate(gs)) for i, (kv, gs) in enumerate(zip(blocks[0].layers, groups, strict=True))]


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
        fp = kv_fingerprint(ns)
        live = engine.scheduler.holding_kv()
        todo: dict[int, tuple[int, int]] = {}  # stable hash -> (block id, window block id or -1)
        for req in live:
            prog = self._progress.setdefault(req.request_id, _Progress())
            block_ids, window_ids = kv_block_ids(req), kv_block_ids(req, WINDOW)
            n_full = min(engine.settled_tokens(req) // bs, len(block_ids))
            if n_full <= prog.done:
                continue
            stable_block_hashes(req.hash_token_ids[: n_full * bs], bs, ns, prog.hashes)
            for i in range(prog.done, n_full):
                if prog.hashes[i] not in self.store:
                    todo.setdefault(prog.hashes[i], (block_ids[i], window_ids[i] if i < len(window_ids) else -1))
            prog.done = n_full
        alive = {r.request_id for r in live}
        for rid in [r for r in self._progress if r not in alive]:
            del self._progress[rid]
        if not todo:
            return []
        groups = kv_groups(engine)
        if groups is None:
            layers = gather_blocks(engine.kv_caches, [b for b, _ in todo.values()])  # one copy per cache tensor
            for j, h in enumerate(todo):
                self.store.put(h, KVBlock([tuple(t[j] for t in kv) for kv in layers],
                                          block_hash=h, fingerprint=fp))
            return list(todo)
        # windowed parts: the window blocks still held; a passed one goes as a 0-row part
        ids = list(todo.values())
        layers = gather_grouped(engine.kv_caches, groups, [b for b, _ in ids], [max(w, 0) for _, w in ids])
        for j, (h, (_, w)) in enumerate(zip(todo, ids, strict=True)):
            self.store.put(h, KVBlock([tuple(t[j] if g != WINDOWED or w >= 0 else missing_part(t[j])
                                             for t, g in zip(kv, gs, strict=True))
                                       for kv, gs in zip(layers, groups, strict=True)],
                                      block_hash=h, fingerprint=fp))
        return list(todo)


def offload(engine: LLMEngine, store: TieredKVStore, namespace: str | None = None) -> list[int]:
    """One-shot offload of every live request's full computed blocks the store lacks."""
    return KVOffloader(store, namespace).offload(engine)
