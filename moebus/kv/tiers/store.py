"""TieredKVStore: fastest tier first; what a tier evicts spills into the next one."""
from __future__ import annotations

from collections.abc import Callable

from moebus.kv.payload import KVBlock
from moebus.kv.tiers.tier import Evicted, Tier


class TieredKVStore:
    """on_evict(hashes) reports blocks that left every tier (e.g. to tell the KV broker)."""

    def __init__(self, tiers: list[Tier], write_through: bool = False, promote: bool = True,
                 on_evict: Callable[[list[int]], None] | None = None) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = tiers
        self.write_through = write_through  # also write every block to the slower tiers at once
        self.promote = promote  # a hit in a slower tier is copied into the fastest
        self.on_evict = on_evict

    def __contains__(self, block_hash: int) -> bool:
        return any(block_hash in t for t in self.tiers)

    def where(self, block_hash: int) -> str | None:
        return next((t.name for t in self.tiers if block_hash in t), None)

    def keys(self) -> list[int]:
        """Every block some tier holds."""
        return list(dict.fromkeys(h for t in self.tiers for h in t.keys()))

    def longest_prefix(self, hashes: list[int]) -> int:
        """How many leading hashes of a chain some tier holds."""
        n = 0
        while n < len(hashes) and hashes[n] in self:
            n += 1
        return n

    def get(self, block_hash: int, fingerprint: int = 0) -> KVBlock | None:
        """The first intact copy, fastest tier first (a tier drops a copy that fails its check or
        is not this block; fingerprint: the reader's kv_fingerprint, 0 for any)."""
        for i, tier in enumerate(self.tiers):
            block = tier.get(block_hash, fingerprint)
            if block is not None:
                if i and self.promote:
                    self._put_from(0, block_hash, block)  # its CPU evictions spill down as usual
                return block
        return None

    def get_prefix(self, hashes: list[int], fingerprint: int = 0) -> list[KVBlock]:
        """Blocks of the leading run of hashes (stops at the first block no tier returns)."""
        out: list[KVBlock] = []
        for h in hashes:
            block = self.get(h, fingerprint)
            if block is None:
                break
            out.append(block)
        return out

    def put(self, block_hash: int, block: KVBlock) -> None:
        if self.write_through:
            for i in range(len(self.tiers)):
                self._put_from(i, block_hash, block, stop=i + 1)
        else:
            self._put_from(0, block_hash, block)

    def _put_from(self, i: int, block_hash: int, block: KVBlock, stop: int | None = None) -> None:
        # Spill cascade: tier i's evictions go to tier i+1, up to `stop` (default: the last).
        stop = len(self.tiers) if stop is None else stop
        pending: list[Evicted] = [(block_hash, block)]
        gone: list[int] = []
        for j in range(i, len(self.tiers)):
            spilled: list[Evicted] = []
            for h, b in pending:
                if j >= stop or b is None:
                    if h not in self:
                        gone.append(h)
                    continue
                spilled += self.tiers[j].put(h, b)
            pending = spilled
            if not pending:
                break
        gone += [h for h, _ in pending if h not in self]
        if gone and self.on_evict is not None:
            self.on_evict(gone)

    def stats(self) -> dict[str, dict[str, int]]:
        return {t.name: {"blocks": len(t), "bytes": t.nbytes, "capacity_bytes": t.capacity_bytes,
                         "hits": t.hits, "misses": t.misses, "corrupt": t.corrupt} for t in self.tiers}
