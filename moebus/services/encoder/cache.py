"""The encoder cache: encoded rows by image content hash, least recently used out first, bounded
by the bytes it stores (images differ in token count)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.size = 0
        self._items: OrderedDict[int, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: int) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: int, value: V, nbytes: int) -> None:
        if nbytes > self.capacity:
            return  # never evict everything for one oversized entry
        old = self._items.pop(key, None)
        if old is not None:
            self.size -= old[1]
        self._items[key] = (value, nbytes)
        self.size += nbytes
        while self.size > self.capacity:
            _, (_, n) = self._items.popitem(last=False)
            self.size -= n
