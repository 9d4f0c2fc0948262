"""What an engine's own (device) prefix cache holds, as stored/evicted stable-hash events.

The block manager knows engine-local hashes only and has no eviction hook, so the tracker
maps the full cached blocks of live requests to stable hashes and notices evictions by
polling the block manager's prefix cache; a worker publishes the diffs to the KV broker.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from moebus.kv.hashing import kv_namespace, request_block_hashes

if TYPE_CHECKING:
    from moebus.kv.host import KVHost


class CacheEventTracker:
    def __init__(self, namespace: str | None = None) -> None:
        self.namespace = namespace
        self._known: dict[int, int] = {}  # engine-local hash -> stable hash, reported as stored

    @property
    def held(self) -> list[int]:
        return list(self._known.values())

    def poll(self, engine: KVHost) -> tuple[list[int], list[int]]:
        """(newly stored, evicted) stable hashes since the last poll."""
        bm, bs = engine.block_manager, engine.block_manager.block_size
        ns = self.namespace or kv_namespace(engine)
        stored: list[int] = []
        live = engine.scheduler.holding_kv()
        for req in live:
            local = req.block_hashes[: engine.settled_tokens(req) // bs]
            n = len(bm.cached_prefix(local))
            if not n or local[n - 1] in self._known:
                continue  # nothing new: chains are reported prefix first
            st = request_block_hashes(req, n, bs, ns)
            for h, s in zip(local[:n], st, strict=False):
                if h not in self._known:
                    self._known[h] = s
                    stored.append(s)
        gone = [h for h in self._known if not bm.is_cached(h)]
        evicted = [self._known.pop(h) for h in gone]
        return stored, evicted
