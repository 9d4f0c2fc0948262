"""Copying newly computed full blocks of an engine's live requests into a TieredKVStore.

KVOffloader runs on the engine thread between steps and uses only the verbs of a KVHost
(kv.host); the connector (kv.connector) wraps it for a worker. With bounded sliding windows
(kv.groups) a block's windowed parts are offloaded while the request still holds them (else the
block goes with its full parts only, the window part as 0 rows). Blocks are made under their
stable hash and the engine's KV fingerprint (kv.payload.KVBlock).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from moebus.kv.cache_io import gather_blocks, gather_grouped, kv_block_ids, kv_groups
from moebus.kv.groups import WINDOW
from moebus.kv.hashing import kv_fingerprint, kv_namespace, request_block_hashes
from moebus.kv.payload import WINDOWED, KVBlock, missing_part
from moebus.kv.tiers.store import TieredKVStore

if TYPE_CHECKING:
    from moebus.kv.host import KVHost


class KVOffloader:
    """Keeps per-request progress so each full block is copied once; call offload(engine) after
    steps (every step, or every few): it returns the stable hashes it newly stored."""

    def __init__(self, store: TieredKVStore, namespace: str | None = None) -> None:
        self.store = store
        self.namespace = namespace
        self._done: dict[str, int] = {}  # request id -> its blocks already offered to the store

    def offload(self, engine: KVHost) -> list[int]:
        bs = engine.block_manager.block_size
        ns = self.namespace or kv_namespace(engine)
        fp = kv_fingerprint(ns)
        live = engine.scheduler.holding_kv()
        todo: dict[int, tuple[int, int]] = {}  # stable hash -> (block id, window block id or -1)
        for req in live:
            done = self._done.get(req.request_id, 0)
            block_ids, window_ids = kv_block_ids(req), kv_block_ids(req, WINDOW)
            n_full = min(engine.settled_tokens(req) // bs, len(block_ids))
            if n_full <= done:
                continue
            hashes = request_block_hashes(req, n_full, bs, ns)
            for i in range(done, n_full):
                if hashes[i] not in self.store:
                    todo.setdefault(hashes[i], (block_ids[i], window_ids[i] if i < len(window_ids) else -1))
            self._done[req.request_id] = n_full
        alive = {r.request_id for r in live}
        for rid in [r for r in self._done if r not in alive]:
            del self._done[rid]
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


def offload(engine: KVHost, store: TieredKVStore, namespace: str | None = None) -> list[int]:
    """One-shot offload of every live request's full computed blocks the store lacks."""
    return KVOffloader(store, namespace).offload(engine)
