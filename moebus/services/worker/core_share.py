"""Co-located workers split the host's cores by who has work, step by step.

`moebus up --workers N` on C cores gives each worker C // N threads, so a lone request computes
on C // N cores while the other workers' cores idle. With a shared directory each worker may take
all C: before every engine step it takes C // (workers with work). A lone request gets every
core; a loaded fleet runs C // N threads a worker with no OpenMP barrier across the workers, so a
core taken by another process (the client, the frontend) stalls one worker instead of all of
them, and each worker's Python part of a step runs while the others compute.

Each worker renews "busy until" (monotonic seconds, CLOCK_MONOTONIC: the same clock in every
process of the host) in its own 8-byte file in the directory while it has work, and writes 0 when
it has none. A worker that dies stops renewing; after `lease_s` it counts as idle. When workers
start at once, one step may run with too many threads in all (each counted the others idle).
"""
from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

_STAMP = struct.Struct("<d")
SUFFIX = ".busy"


class CoreShare:
    def __init__(self, directory: str | os.PathLike, name: str, cores: int, lease_s: float = 10.0,
                 rescan_s: float = 1.0) -> None:
        """cores: what all the workers of the directory share; lease_s: longer than any step."""
        if cores < 1:
            raise ValueError("cores must be >= 1")
        self.dir, self.cores, self.lease_s, self.rescan_s = Path(directory), cores, lease_s, rescan_s
        self.dir.mkdir(parents=True, exist_ok=True)
        self._own_path = self.dir / f"{name}{SUFFIX}"
        self._own = os.open(self._own_path, os.O_RDWR | os.O_CREAT, 0o600)
        self._peers: dict[str, int] = {}  # file name -> fd
        self._scanned = -float("inf")

    def threads(self, busy: bool, now: float | None = None) -> int:
        """Mark this worker busy (or idle) and return the threads its next step should use."""
        now = time.monotonic() if now is None else now
        os.pwrite(self._own, _STAMP.pack(now + self.lease_s if busy else 0.0), 0)
        if now - self._scanned >= self.rescan_s:
            self._rescan(now)
        busy_peers = sum(1 for fd in self._peers.values() if _read(fd) > now)
        return max(1, self.cores // (busy_peers + 1))

    def _rescan(self, now: float) -> None:
        self._scanned = now
        names = {p.name for p in self.dir.glob(f"*{SUFFIX}") if p != self._own_path}
        for gone in self._peers.keys() - names:
            os.close(self._peers.pop(gone))
        for new in names - self._peers.keys():
            try:
                self._peers[new] = os.open(self.dir / new, os.O_RDONLY)
            except FileNotFoundError:  # removed since the listing
                pass

    def close(self) -> None:
        """Leave: the file goes, so the others count one worker fewer at their next rescan."""
        for fd in self._peers.values():
            os.close(fd)
        self._peers.clear()
        os.close(self._own)
        self._own_path.unlink(missing_ok=True)


def _read(fd: int) -> float:
    data = os.pread(fd, _STAMP.size, 0)
    return _STAMP.unpack(data)[0] if len(data) == _STAMP.size else 0.0


def torch_pacer(share: CoreShare) -> Callable[[bool], None]:
    """For the engine thread, before each step (busy) and while idle: sets its torch (OpenMP)
    threads to the share's answer when that changes."""
    import torch  # the worker imports torch only for a real engine

    current: int | None = None

    def pace(busy: bool) -> None:
        nonlocal current
        n = share.threads(busy)
        if busy and n != current:
            torch.set_num_threads(n)
            current = n

    return pace
