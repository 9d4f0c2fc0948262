"""CpuTier: KV blocks in host memory, LRU by bytes; each checked against its checksum (which
covers its identity) when read."""
from __future__ import annotations

from collections.abc import Callable

import torch

from moebus.kv.payload import KVBlock, KVChecksumError
from moebus.kv.tiers.tier import Tier


def _own(t: torch.Tensor) -> torch.Tensor:
    # A view into a bigger payload tensor would keep all of it alive past its accounted bytes.
    t = t.detach().to("cpu")
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t.contiguous()


class CpuTier(Tier):
    name = "cpu"

    def __init__(self, capacity_bytes: int, on_corrupt: Callable[[str], None] | None = None) -> None:
        super().__init__(capacity_bytes, on_corrupt)
        self._blocks: dict[int, KVBlock] = {}

    def _read(self, block_hash: int) -> KVBlock | None:
        block = self._blocks.get(block_hash)
        if block is not None and not block.intact():  # host memory can flip bits too (no ECC, bugs)
            raise KVChecksumError("block data fails its checksum")
        return block

    def _write(self, block_hash: int, block: KVBlock) -> None:
        # The checksum is the one the block came with, not recomputed from what is stored, so a
        # block damaged before it got here is still caught on the way out.
        self._blocks[block_hash] = KVBlock([tuple(_own(t) for t in kv) for kv in block.layers], block.checksum,
                                           block.block_hash, block.fingerprint)

    def _remove(self, block_hash: int) -> None:
        self._blocks.pop(block_hash, None)

    def _evict_block(self, block_hash: int) -> KVBlock | None:
        return self._blocks.get(block_hash)
