"""Block manager of an engine with two KV groups (kv.groups).

The full-history parts live in `req.block_ids` (the base BlockManager, unchanged). The windowed
parts, read only within the last `horizon` tokens, live in a second pool, `self.win`, indexed by
`req.window_block_ids`: logical block i of the request, or -1 once the window has passed it (or
when a long prompt's prefix hit never needed it). A passed block goes back to the LRU free list
with its hash kept, so a later request with the same prefix can still revive it.

Prefix hits: n blocks count only when the full pool caches all n and the window pool caches the
blocks the next token's window reads; otherwise the hit shrinks to the longest shorter prefix that
has them, and the tokens after it are recomputed ("replay"), so a hit equals a cold run.

KV that arrives from elsewhere (kv.transfer, kv.tiers) is reserved for a request whose
num_computed_tokens is already set to where that KV ends: only the window from there on is
allocated (and a local hit only needs its blocks inside that window), however long the prompt.
"""
from __future__ import annotations

from moebus.engine.block_manager import BlockManager
from moebus.engine.request import Request


class WindowedBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, window_blocks: int,
                 horizon: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if horizon < 1:
            raise ValueError("horizon must be >= 1")
        self.horizon = horizon
        self.win = BlockManager(window_blocks, block_size, enable_prefix_caching)

    @property
    def usage(self) -> float:
        return max(1.0 - len(self.free) / len(self.blocks), self.win.usage)

    def first_live(self, computed: int) -> int:
        """Logical index of the first window block read by the tokens from `computed` on."""
        return max(0, computed - self.horizon + 1) // self.block_size

    def window_blocks_held(self, req: Request) -> int:
        return sum(1 for b in req.window_block_ids if b >= 0)

    def window_cached(self, block_hashes: list[int], lo: int, hi: int) -> list[int] | None:
        """Window-pool ids of blocks [lo, hi) in the prefix cache; None if one is not."""
        ids = []
        for i in range(lo, hi):
            bid = self.win.cached.get(block_hashes[i])
            if bid is None:
                return None
            ids.append(bid)
        return ids

    def _window_hits(self, req: Request, n_hit: int, start: int | None = None) -> list[int] | None:
        """The window blocks of an n_hit-block hit read from token `start` on (default: the hit's end)."""
        lo = self.first_live(n_hit * self.block_size if start is None else start)
        return self.window_cached(req.block_hashes, lo, n_hit)

    def match_prefix(self, req: Request) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        hits = self.cached_prefix(self.full_block_hashes(req))
        n = len(hits)
        while n and n * self.block_size >= req.num_tokens:
            n -= 1  # the last token must run through the model to produce logits
        while n and self._window_hits(req, n) is None:
            n -= 1  # the window tail of this hit was evicted: replay from an earlier prefix
        self.queries += 1
        self.hits += bool(n)
        return hits[:n]

    def _window_plan(self, req: Request, num_tokens: int, cached: list[int]) -> tuple[int, list[int], int]:
        """(first live index, window-pool prefix hits from there, fresh blocks still needed)."""
        start = max(len(cached) * self.block_size, req.num_computed_tokens)  # the latter: KV from elsewhere
        lo, hi = self.first_live(start), -(-num_tokens // self.block_size)
        hits = self._window_hits(req, len(cached), start) if cached else []
        if hits is None:  # not from match_prefix: the window tail's KV is nowhere
            raise ValueError(f"{req.request_id}: a prefix hit of {len(cached)} blocks whose window tail is not cached")
        have = req.window_block_ids
        missing = sum(1 for i in range(lo + len(hits), hi) if i >= len(have) or have[i] < 0)
        return lo, hits, missing

    def can_allocate(self, req: Request, num_tokens: int, cached: list[int] = ()) -> bool:
        if not super().can_allocate(req, num_tokens, cached):
            return False
        _, hits, missing = self._window_plan(req, num_tokens, cached)
        return missing + self.win.num_free_of(hits) <= self.win.num_free_blocks

    def allocate(self, req: Request, num_tokens: int, cached: list[int] = ()) -> None:
        lo, hits, _ = self._window_plan(req, num_tokens, cached)
        super().allocate(req, num_tokens, cached)
        ids = req.window_block_ids
        hi = -(-num_tokens // self.block_size)
        ids.extend([-1] * (max(hi, len(cached)) - len(ids)))
        for k, bid in enumerate(hits):
            self.win.take(bid)
            ids[lo + k] = bid
        for i in range(lo, hi):
            if ids[i] < 0:
                ids[i] = self.win.pop_free()

    def trim(self, req: Request) -> None:
        """Free the window blocks no token from req.num_computed_tokens on reads (tail first)."""
        ids = req.window_block_ids
        i = min(self.first_live(req.num_computed_tokens), len(ids)) - 1
        while i >= 0 and ids[i] >= 0:
            self.win.release(ids[i])
            ids[i] = -1
            i -= 1

    def cache_blocks(self, req: Request) -> None:
        super().cache_blocks(req)
        if not self.enable_prefix_caching:
            return
        hashes, ids = req.block_hashes, req.window_block_ids
        n_full = min(req.num_computed_tokens // self.block_size, len(hashes), len(ids))
        for i in range(_first_held(ids), n_full):
            self.win.publish(ids[i], hashes[i])

    def free_request(self, req: Request) -> None:
        super().free_request(req)
        for bid in reversed(req.window_block_ids):
            if bid >= 0:
                self.win.release(bid)
        req.window_block_ids = []

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.win.reset_prefix_cache()


def _first_held(ids: list[int]) -> int:
    """Index of the first held block: the -1 entries (passed by the window) form a prefix."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if ids[mid] < 0:
            lo = mid + 1
        else:
            hi = mid
    return lo
