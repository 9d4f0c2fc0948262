"""CpuTier: KV blocks in host memory, LRU by bytes."""
from __future__ import annotations

import torch

from moebus.engine.kv_tiers.base import Tier
from moebus.engine.kv_transfer.payload import KVBlock


def _own(t: torch.Tensor) -> torch.Tensor:
    # A view into a bigger payload tensor would keep all of it alive past its accounted bytes.
    t = t.detach().to("cpu")
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t.contiguous()


class CpuTier(Tier):
    name = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._blocks: dict[int, KVBlock] = {}

    def _read(self, block_hash: int) -> KVBlock | None:
        return self._blocks.get(block_hash)

    def _write(self, block_hash: int, block: KVBlock) -> None:
        self._blocks[block_hash] = KVBlock([(_own(k), _own(v)) for k, v in block.layers])

    def _remove(self, block_hash: int) -> None:
        self._blocks.pop(block_hash, None)

    def _evict_block(self, block_hash: int) -> KVBlock | None:
        return self._blocks.get(block_hash)
