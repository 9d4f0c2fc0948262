"""DiskTier: one file per block hash in a directory, LRU by bytes, survives restarts.

Writes are atomic: the encoding goes to a temporary file in the same directory that is renamed
over the block's name, so a reader sees the old file, the new one, or none, never a half-written
one; start-up deletes leftover temporaries and rebuilds the LRU index from the files' mtimes
(reads touch the mtime, so recency survives a restart too).

fsync policy: off by default. The tier is a cache, and every read checks the encoding's header
checksum, its length and the block's data checksum, so a file that a power loss left short or
zeroed reads as corrupt, is deleted and recomputed, never served. fsync=True syncs the file before
the rename and the directory after it: a block that exists after a crash is then whole, at the
cost of two syncs per block written.

A file names the block hash it was written under (its header, covered by the block's checksum),
so one renamed, copied or swapped to another block's name reads as corrupt too (Tier.get).
"""
from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from moebus.kv.payload import KVBlock
from moebus.kv.tiers.tier import Tier

log = logging.getLogger(__name__)
SUFFIX = ".kvb"


class DiskTier(Tier):
    name = "disk"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fsync: bool = False,
                 on_corrupt: Callable[[str], None] | None = None) -> None:
        super().__init__(capacity_bytes, on_corrupt)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._rebuild()

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    def _rebuild(self) -> None:
        found: list[tuple[float, int, int]] = []
        for p in self.dir.iterdir():
            if p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)  # an interrupted write
            elif p.suffix == SUFFIX:
                try:
                    st = p.stat()
                    found.append((st.st_mtime, int(p.stem, 16), st.st_size))
                except (OSError, ValueError):
                    log.warning("ignoring %s in the KV disk tier", p)
        for _, h, size in sorted(found):
            self._lru[h] = size
            self._bytes += size
        while self._bytes > self.capacity_bytes and self._lru:  # the limit may have shrunk
            self._drop(next(iter(self._lru)))

    def _read(self, block_hash: int) -> KVBlock | None:
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # removed by hand: a plain miss
            return None
        except OSError as e:  # an I/O error: the block is there but cannot be trusted
            raise ValueError(f"unreadable {path.name}: {e}") from e
        block = KVBlock.decode(data)  # ValueError: torn, truncated, fails a checksum, another version
        try:
            os.utime(path)
        except OSError:
            pass
        return block

    def _write(self, block_hash: int, block: KVBlock) -> None:
        path = self._path(block_hash)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        data = block.packed().to_bytes()  # carries the block's own checksum, not one of these bytes
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:  # make the rename itself durable
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _size_of(self, block: KVBlock) -> int:
        return block.packed().nbytes  # the file's size: header + aligned blobs

    def _remove(self, block_hash: int) -> None:
        self._path(block_hash).unlink(missing_ok=True)

    def _touch(self, block_hash: int) -> None:
        try:
            os.utime(self._path(block_hash))
        except OSError:
            pass
