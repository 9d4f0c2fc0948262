"""What every KV tier offers: blocks by stable block hash, LRU by bytes under a size limit.

A block is checked against the checksum it carries on every get: one that fails (or cannot be
read back whole) is dropped, counted in `corrupt` (and `on_corrupt(tier name)`, e.g. a metric),
and reported as a miss, so the engine recomputes it; it is never served. So is an intact block
that is not the one asked for: a put stamps a block with the key it is stored under (one that
already names a key keeps it), and a get compares that with the key asked for (and the reader's
KV fingerprint, when it gives one): a file renamed or swapped to another key is never served.
"""
from __future__ import annotations

import abc
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from moebus.kv.payload import KVBlock

log = logging.getLogger(__name__)
Evicted = tuple[int, KVBlock | None]  # (hash, the block when the tier still had it in memory)


class Tier(abc.ABC):
    """Thread-safe: the engine thread loads/offloads while a service thread answers peers."""

    name: str = "tier"

    def __init__(self, capacity_bytes: int, on_corrupt: Callable[[str], None] | None = None) -> None:
        if capacity_bytes < 1:
            raise ValueError("capacity_bytes must be >= 1")
        self.capacity_bytes = capacity_bytes
        self.on_corrupt = on_corrupt
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> bytes; front is evicted first
        self._bytes = 0
        self._lock = threading.RLock()
        self.hits = self.misses = self.corrupt = 0

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

    def get(self, block_hash: int, fingerprint: int = 0) -> KVBlock | None:
        """The block stored under block_hash; fingerprint: the reader's kv_fingerprint (0: any)."""
        with self._lock:
            if block_hash not in self._lru:
                self.misses += 1
                return None
            try:
                block = self._read(block_hash)
                if block is not None:
                    block.check_identity(block_hash, fingerprint)
            except ValueError as e:  # fails its checksum, names another key, truncated, undecodable
                self._drop(block_hash)
                self.misses += 1
                self._count_corrupt(block_hash, e)
                return None
            if block is None:  # lost underneath us (e.g. a file removed by hand)
                self._drop(block_hash)
                self.misses += 1
                return None
            self._lru.move_to_end(block_hash)
            self.hits += 1
            return block

    def put(self, block_hash: int, block: KVBlock) -> list[Evicted]:
        """Store (or refresh) a block; returns what the size limit pushed out, oldest first."""
        block = block.keyed(block_hash)
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
            try:
                self._write(block_hash, block)
            except OSError as e:  # e.g. a full disk: the block is not kept here, like one too large
                log.warning("%s tier could not store KV block %016x: %s", self.name, block_hash, e)
                return [*evicted, (block_hash, block)]
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

    def _count_corrupt(self, block_hash: int, error: ValueError) -> None:
        self.corrupt += 1
        # The first one per tier is a warning; the rest only count (a failing disk would flood the log).
        log.log(logging.WARNING if self.corrupt == 1 else logging.DEBUG,
                "%s tier dropped KV block %016x: %s (recomputed; %d so far)", self.name, block_hash, error,
                self.corrupt)
        if self.on_corrupt is not None:
            self.on_corrupt(self.name)

    # --- storage hooks ---------------------------------------------------------------------
    @abc.abstractmethod
    def _read(self, block_hash: int) -> KVBlock | None:
        """The block, checked; None when it is gone; ValueError when it is there but damaged."""

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
