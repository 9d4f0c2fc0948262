"""Filling an engine's prefix cache from a TieredKVStore before a waiting request is scheduled.

load_prefix runs on the engine thread when the scheduler is about to admit a waiting request
(the connector's before_admit, kv.connector), so its ordinary `match_prefix` turns tier hits into
cache hits. It uses only the verbs of a KVHost
(kv.host: the engine, its scheduler and block manager); the connector (kv.connector) wraps it
for a worker. A block is every tensor of every layer's cache tuple (k, v, *planes), so
DeepSeek-V4's compressor state travels with it.

With bounded sliding windows (kv.groups) a prefix is restored only as far as its window tail is
there (in the tier or the engine's window pool); a shorter one otherwise, whose tokens after it
are recomputed. Blocks are read back asking for their stable hash and the engine's KV
fingerprint (kv.payload.KVBlock): a tier block of another key, model or cache layout is dropped
there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moebus.engine.request import Request, RequestStatus
from moebus.kv.cache_io import kv_block_ids, kv_groups, lookup, scatter_blocks, scatter_grouped
from moebus.kv.groups import WINDOW
from moebus.kv.hashing import kv_fingerprint, kv_namespace, request_block_hashes
from moebus.kv.payload import WINDOWED, Groups, KVBlock, LayerKV, stack_blocks
from moebus.kv.tiers.store import TieredKVStore

if TYPE_CHECKING:
    from moebus.kv.host import KVHost


def load_prefix(engine: KVHost, request: str | Request, store: TieredKVStore,
                namespace: str | None = None) -> int:
    """Load the blocks beyond the local prefix-cache hit that the store holds; returns how many
    prompt tokens are now cached. Call while the request waits, before the step that admits it."""
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
    stable = request_block_hashes(req, max_blocks, bs, ns)
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
    try:
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
    except BaseException:
        carrier.num_computed_tokens = 0
        bm.free_request(carrier)  # half-filled blocks go back unpublished
        raise
    carrier.num_computed_tokens = n
    bm.cache_blocks(carrier)
    bm.free_request(carrier)
    return n


def _with_window_tail(engine: KVHost, req: Request, n_local: int, blocks: list[KVBlock],
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
