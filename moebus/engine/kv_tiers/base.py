"""What every KV tier offers: blocks by stable block hash, LRU by bytes under a size limit."""
from __future__ import annotations

import abc
import threading
from collections import OrderedDict

from moebus.engine.kv_transfer.payload import KVBlock

Evicted = tuple[int, KVBlock | None]  # (hash, the block when the tier still had it in memory)


class Tier(abc.ABC):
    """Thread-safe: the engine thread loads/offloads while a service thread answers peers."""

    name: str = "tier"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError("capacity_bytes must be >= 1")
        self.capacity_bytes = capacity_bytes
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> bytes; front is evicted first
        self._bytes = 0
        self._lock = threading.RLock()
        self.hits = self.misses = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def keys(self) -> list[int]:
        with self._lock:
            return list(self._lru)

    def get(self, block_hash: int) -> KVBlock | None:
        with self._lock:
            if block_hash not in self._lru:
                self.misses += 1
                return None
            block = self._read(block_hash)
            if block is None:  # lost underneath us (e.g. a file removed by hand)
                self._drop(block_hash)
                self.misses += 1
                return None
            self._lru.move_to_end(block_hash)
            self.hits += 1
            return block

    def put(self, block_hash: int, block: KVBlock) -> list[Evicted]:
        """Store (or refresh) a block; returns what the size limit pushed out, oldest first."""
        with self._lock:
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)
                self._touch(block_hash)
                return []
            size = self._size_of(block)
            if size > self.capacity_bytes:
                return [(block_hash, block)]
            evicted: list[Evicted] = []
            while self._bytes + size > self.capacity_bytes:
                old, _ = next(iter(self._lru.items()))
                evicted.append((old, self._evict_block(old)))
                self._drop(old)
            self._write(block_hash, block)
            self._lru[block_hash] = size
            self._bytes += size
            return evicted

    def discard(self, block_hash: int) -> None:
        with self._lock:
            if block_hash in self._lru:
                self._drop(block_hash)

    def _drop(self, block_hash: int) -> None:
        self._bytes -= self._lru.pop(block_hash)
        self._remove(block_hash)

    # --- storage hooks ---------------------------------------------------------------------
    @abc.abstractmethod
    def _read(self, block_hash: int) -> KVBlock | None: ...

    @abc.abstractmethod
    def _write(self, block_hash: int, block: KVBlock) -> None: ...

    @abc.abstractmethod
    def _remove(self, block_hash: int) -> None: ...

    def _size_of(self, block: KVBlock) -> int:
        return block.nbytes

    def _evict_block(self, block_hash: int) -> KVBlock | None:
        """The block handed to the next tier on eviction (None: too costly to fetch)."""
        return None

    def _touch(self, block_hash: int) -> None:  # noqa: B027  (optional hook)
        pass
