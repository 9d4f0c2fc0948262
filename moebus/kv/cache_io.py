"""Reading and writing blocks of an engine's paged KV cache: the gathers and scatters that
transfer.py and tiers/ (load, offload) share, and the one place they read a request's block tables.

A layer's cache is the tuple (k, v, *planes) (DeepSeek-V4's compressed layers add compressor
planes); every tensor of it moves, checked against the receiving cache tensor by tensor. With
bounded sliding windows (kv.groups) a windowed tensor is indexed by the request's window block
list, each tensor by its own group's block ids.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moebus.engine.request import Request
from moebus.kv.groups import FULL, group_block_ids
from moebus.kv.payload import Groups, LayerKV

if TYPE_CHECKING:
    from moebus.kv.host import KVHost

KVCaches = list[tuple[torch.Tensor, ...]]  # per layer (k, v, *planes), each indexed by block id first


def kv_block_ids(req: Request, group: int = FULL) -> list[int]:
    """The request's cache blocks of `group` by logical block index (WINDOW: -1 = freed). The one
    place transfer and tiers read a request's block tables."""
    return group_block_ids(req, group)


def kv_groups(engine: KVHost) -> Groups | None:
    """Per layer, per cache tensor: FULL or WINDOW; None when the engine has one group."""
    layout = getattr(engine, "kv_layout", None)
    return [tuple(g) for g in layout.groups] if layout is not None and layout.grouped else None


def _per_group(kv_caches: KVCaches, groups: Groups | None) -> Groups:
    """groups, or every tensor FULL for an engine with one group."""
    return groups if groups is not None else [(FULL,) * len(layer) for layer in kv_caches]


def _group_index(kv_caches: KVCaches, full_ids: list[int], window_ids: list[int]) -> tuple[torch.Tensor, ...]:
    dev = kv_caches[0][0].device
    return tuple(torch.tensor(ids, dtype=torch.long, device=dev) for ids in (full_ids, window_ids))


def gather_grouped(kv_caches: KVCaches, groups: Groups | None, full_ids: list[int], window_ids: list[int],
                   device: str | torch.device = "cpu") -> LayerKV:
    """Per layer (k, v, *planes): each tensor's blocks at its own group's ids, one gather per tensor
    (groups None: one group, every tensor at full_ids)."""
    idx = _group_index(kv_caches, full_ids, window_ids)
    return [tuple(t.index_select(0, idx[g]).to(device) for t, g in zip(layer, gs, strict=True))
            for layer, gs in zip(kv_caches, _per_group(kv_caches, groups), strict=True)]


def scatter_grouped(kv_caches: KVCaches, groups: Groups | None, full_ids: list[int], window_ids: list[int],
                    layers: LayerKV) -> None:
    """Write per-layer block data into the cache: each tensor's first rows into its own group's ids
    (groups None: one group, every tensor into full_ids)."""
    if problem := layout_problem(layers, kv_caches):
        raise ValueError(problem)
    ids = (full_ids, window_ids)
    idx = _group_index(kv_caches, full_ids, window_ids)
    for dst, src, gs in zip(kv_caches, layers, _per_group(kv_caches, groups), strict=True):
        for d, s, g in zip(dst, src, gs, strict=True):
            if ids[g]:
                d.index_copy_(0, idx[g], s[: len(ids[g])].to(d.device, d.dtype))


def gather_blocks(kv_caches: KVCaches, block_ids: list[int], device: str | torch.device = "cpu") -> LayerKV:
    """Per layer (k, v, *planes), each [len(block_ids), ...]: one gather per cache tensor."""
    return gather_grouped(kv_caches, None, block_ids, [], device)


def layout_problem(layers: LayerKV, kv_caches: KVCaches) -> str:
    """Why per-layer block data cannot go into these caches ("" when it can): every layer must
    bring as many tensors as its cache tuple, each with the cache tensor's per-block shape."""
    if len(layers) != len(kv_caches):
        return f"payload has {len(layers)} layers, the cache {len(kv_caches)}"
    for i, (src, dst) in enumerate(zip(layers, kv_caches, strict=True)):
        if len(src) != len(dst):
            return f"layer {i}: {len(src)} cache tensors, the cache {len(dst)}"
        for j, (s, d) in enumerate(zip(src, dst, strict=True)):
            if s.shape[1:] != d.shape[1:] and (s.shape[0] or s.shape[2:] != d.shape[2:]):  # 0 blocks: no rows
                return f"layer {i} tensor {j}: block shape {tuple(s.shape[1:])}, the cache {tuple(d.shape[1:])}"
    return ""


def scatter_blocks(kv_caches: KVCaches, block_ids: list[int], layers: LayerKV) -> None:
    """Write per-layer block data (first len(block_ids) blocks of each tensor) into the cache."""
    scatter_grouped(kv_caches, None, block_ids, [], layers)


def lookup(engine: KVHost, request: str | Request) -> Request:
    """The live engine request (of an n > 1 request: its first choice); KeyError if none."""
    return request if isinstance(request, Request) else engine.get_request(request)
