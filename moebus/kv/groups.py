"""KV groups: which cache parts live in which block pool, and what each pool costs.

Every layer's cache is a tuple (k, v, *planes) (engine.attention). A part read only within the
last `horizon` tokens (a sliding window's K/V, a KV compressor's pending rows) is windowed: with
bounding on, every windowed part lives in one second pool whose blocks a request frees once its
window has passed them (engine.window_blocks), so they cost O(window) per request however long the
context. Parts read over the whole history (full attention, compressed entries, indexer keys) stay
in the full pool, indexed by `req.block_ids` as before. Bounding off, or no windowed part: one
group, the single-pool layout and per-step work of before.

All windowed parts share one horizon (the largest): at most a few blocks more for the shorter
ones, and one block table instead of one per horizon.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moebus.engine.attention import KVCacheSpec
from moebus.engine.block_manager import BlockManager
from moebus.engine.request import Request
from moebus.engine.window_blocks import WindowedBlockManager

FULL, WINDOW = 0, 1


def group_block_ids(req: Request, group: int) -> list[int]:
    """The blocks of request `req` in `group` by logical index; in WINDOW, -1 = not held."""
    return req.window_block_ids if group == WINDOW else req.block_ids


def _part_sizes(spec: KVCacheSpec, block_size: int) -> tuple[int, ...]:
    """Values per block of each part (k, v, *planes)."""
    return (spec.num_kv_heads * spec.k_dim * block_size, spec.num_kv_heads * spec.v_dim * block_size,
            *(p.rows_per_block(block_size) * p.dim for p in spec.planes))


@dataclass(frozen=True, slots=True)
class KVLayout:
    groups: tuple[tuple[int, ...], ...]  # per layer, per cache part: FULL or WINDOW
    horizon: int | None  # the windowed group's horizon; None = one group (everything FULL)

    @classmethod
    def plan(cls, specs: list[KVCacheSpec], bounded: bool) -> KVLayout:
        hs = [s.horizons() for s in specs]
        bounded_hs = [h for row in hs for h in row if h is not None]
        if not bounded or not bounded_hs:
            return cls(tuple((FULL,) * len(row) for row in hs), None)
        return cls(tuple(tuple(FULL if h is None else WINDOW for h in row) for row in hs), max(bounded_hs))

    @property
    def grouped(self) -> bool:
        return self.horizon is not None

    def bytes_per_block(self, specs: list[KVCacheSpec], block_size: int, dtype: torch.dtype) -> tuple[int, int]:
        """(FULL, WINDOW) bytes of one block of each pool, all layers together."""
        out = [0, 0]
        for spec, groups in zip(specs, self.groups, strict=True):
            for n, g in zip(_part_sizes(spec, block_size), groups, strict=True):
                out[g] += n
        size = torch.empty((), dtype=dtype).element_size()
        return out[FULL] * size, out[WINDOW] * size

    def blocks_per_request(self, context: int, block_size: int) -> tuple[int, int]:
        """(FULL, WINDOW) blocks a request holds while computing the last token of `context`."""
        last = context - 1
        full = last // block_size + 1
        if not self.grouped:
            return full, 0
        return full, full - max(0, last - self.horizon + 1) // block_size

    def bytes_per_request(self, specs: list[KVCacheSpec], context: int, block_size: int,
                          dtype: torch.dtype) -> int:
        per_full, per_window = self.bytes_per_block(specs, block_size, dtype)
        n_full, n_window = self.blocks_per_request(context, block_size)
        return n_full * per_full + n_window * per_window


def allocate_caches(specs: list[KVCacheSpec], layout: KVLayout, num_blocks: tuple[int, int], block_size: int,
                    dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (k, v, *planes), each indexed first by a block id of its own group's pool."""
    caches = []
    for spec, groups in zip(specs, layout.groups, strict=True):
        n = [num_blocks[g] for g in groups]
        h = spec.num_kv_heads
        caches.append((torch.zeros(n[0], block_size, h, spec.k_dim, dtype=dtype, device=device),
                       torch.zeros(n[1], block_size, h, spec.v_dim, dtype=dtype, device=device),
                       *(torch.zeros(m, p.rows_per_block(block_size), p.dim, dtype=dtype, device=device)
                         for m, p in zip(n[2:], spec.planes, strict=True))))
    return caches


@dataclass(frozen=True, slots=True)
class PoolSizing:
    block_size: int
    kv_cache_bytes: int
    num_kv_blocks: int | None  # given: the full pool's size (and the window pool's cap)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


def pool_sizes(specs: list[KVCacheSpec], layout: KVLayout, s: PoolSizing, dtype: torch.dtype) -> tuple[int, int]:
    """(FULL, WINDOW) blocks. The window pool gets what a full batch can hold at once (every
    sequence's window plus a step's worth of new tokens) twice over, so passed blocks linger for
    prefix hits, within half the bytes (but never less than one full prefill chunk's); the full
    pool gets the rest."""
    per_full, per_window = layout.bytes_per_block(specs, s.block_size, dtype)
    if not layout.grouped:
        return s.num_kv_blocks or max(16, s.kv_cache_bytes // per_full), 0
    bs = s.block_size
    batch = s.max_num_seqs * (-(-layout.horizon // bs) + 2) + -(-s.max_num_batched_tokens // bs)
    if per_full == 0:  # every part windowed: the full pool only names blocks (hashes, no tensors)
        window = s.num_kv_blocks or max(16, s.kv_cache_bytes // per_window)
        return s.max_num_seqs * -(-s.max_model_len // bs) + 1, window
    if s.num_kv_blocks is not None:
        return s.num_kv_blocks, min(2 * batch, s.num_kv_blocks)
    one_chunk = -(-s.max_num_batched_tokens // bs) + -(-layout.horizon // bs) + 2  # else a full chunk never fits
    window = max(16, one_chunk, min(2 * batch, s.kv_cache_bytes // 2 // per_window))
    return max(16, (s.kv_cache_bytes - window * per_window) // per_full), window


def build_block_manager(layout: KVLayout, num_blocks: tuple[int, int], block_size: int,
                        enable_prefix_caching: bool) -> BlockManager:
    if not layout.grouped:
        return BlockManager(num_blocks[FULL], block_size, enable_prefix_caching)
    return WindowedBlockManager(num_blocks[FULL], block_size, enable_prefix_caching, num_blocks[WINDOW],
                                layout.horizon)
