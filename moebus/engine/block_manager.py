"""Paged KV blocks: ref counts, prefix cache by chained block hashes, LRU eviction of free blocks."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from moebus.engine.request import Request


def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    # Chaining makes a block's hash name its whole prefix, so equal hashes mean equal KV. Only ints are
    # hashed (hash(None) is per-process on 3.11), so the value is the same in every process.
    return hash((-1 if prev is None else prev, tokens))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in LRU order: the front is evicted first; cached blocks keep their hash until then.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.hits = 0
        self.queries = 0
        self.allocated = 0  # blocks taken from the free list (prefix-cache hits not counted)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(req.block_ids))

    def pop_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        self.allocated += 1
        blk = self.blocks[bid]
        if blk.block_hash is not None:  # evict from the prefix cache
            if self.cached.get(blk.block_hash) == bid:
                del self.cached[blk.block_hash]
            blk.block_hash = None
        blk.ref_count = 1
        return bid

    def take(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            del self.free[bid]
        blk.ref_count += 1

    def full_block_hashes(self, req: Request) -> list[int]:
        """Chained hashes of every full block of the request's known tokens (cached on the request)."""
        bs, hashes = self.block_size, req.block_hashes
        if (len(hashes) + 1) * bs > req.num_tokens:
            return hashes  # no new full block (most decode steps): skip building the token list
        toks = req.hash_token_ids
        while (len(hashes) + 1) * bs <= len(toks):
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None, tuple(toks[i * bs:(i + 1) * bs])))
        return hashes

    def cached_prefix(self, hashes: list[int]) -> list[int]:
        """Block ids of the leading hashes the prefix cache holds (no hit counted)."""
        hits: list[int] = []
        for h in hashes:
            bid = self.cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self.cached

    def num_free_of(self, block_ids: list[int]) -> int:
        """How many of these (cached) blocks are free: taking them uses up free blocks."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def match_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        hits = self.cached_prefix(self.full_block_hashes(req))
        while hits and len(hits) * self.block_size >= req.num_tokens:
            hits.pop()  # the last token must run through the model to produce logits
        self.queries += 1
        self.hits += bool(hits)
        return hits

    def can_allocate(self, req: Request, num_tokens: int, cached: list[int] = ()) -> bool:
        revived = self.num_free_of(cached)
        need = self.blocks_needed(req, num_tokens) - len(cached)
        return need + revived <= len(self.free)

    def allocate(self, req: Request, num_tokens: int, cached: list[int] = ()) -> None:
        """Grow req's block table to hold num_tokens, first reusing cached prefix blocks."""
        for bid in cached:
            self.take(bid)
            req.block_ids.append(bid)
        if cached:
            req.num_computed_tokens = len(cached) * self.block_size
            req.num_cached_tokens = req.num_computed_tokens
        for _ in range(self.blocks_needed(req, num_tokens)):
            req.block_ids.append(self.pop_free())

    def trim(self, req: Request) -> None:
        """Free blocks no further token of req reads: none in a full-attention pool (the windowed
        manager overrides it)."""

    def cache_blocks(self, req: Request) -> None:
        """Publish the hashes of req's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        hashes = self.full_block_hashes(req)
        n_full = min(req.num_computed_tokens // self.block_size, len(hashes), len(req.block_ids))
        for i in range(n_full):
            self.publish(req.block_ids[i], hashes[i])

    def release(self, bid: int) -> None:
        """Drop one reference; a block nobody holds joins the LRU free list (its hash kept)."""
        blk = self.blocks[bid]
        blk.ref_count -= 1
        if blk.ref_count == 0:
            self.free[bid] = None

    def publish(self, bid: int, block_hash: int) -> None:
        """Name a full, computed block by its chained hash in the prefix cache (first holder wins)."""
        blk = self.blocks[bid]
        if blk.block_hash is None and block_hash not in self.cached:
            blk.block_hash = block_hash
            self.cached[block_hash] = bid

    def free_request(self, req: Request) -> None:
        # Tail blocks first so the LRU evicts a prefix's last blocks before its shared first ones.
        for bid in reversed(req.block_ids):
            self.release(bid)
        req.block_ids = []

    def reset_prefix_cache(self) -> None:
        for blk in self.blocks:
            if blk.ref_count == 0:
                blk.block_hash = None
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].block_hash == h}
