"""Co-located workers split the host's cores by who has work, step by step.

`moebus up --workers N` on C cores gives each worker C // N threads, so a lone request computes
on C // N cores while the other workers' cores idle. With a shared directory each worker may take
all C: before every engine step it takes C // (workers with work). A lone request gets every
core; a loaded fleet runs C // N threads a worker with no OpenMP barrier across the workers, so a
core taken by another process (the client, the frontend) stalls one worker instead of all of
them, and each worker's Python part of a step runs while the others compute.

Each worker keeps "busy until" (monotonic seconds, CLOCK_MONOTONIC: the same clock in every
process of the host), the threads its current step uses and its pid in its own small file in the
directory, renewed before each step while it has work and zeroed when it has none. A worker whose
process is gone counts as idle at once; one that lives but stops renewing, after `lease_s`. A
worker that gets work while a busy peer still holds the cores (a step started alone, with all of
them) waits for that peer's next step, where the peer takes its smaller share: two sets of
spinning OpenMP threads on the same cores would stall each other at every barrier. More busy
workers than cores run one thread each.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

_STATE = struct.Struct("<ddq")  # busy until, threads of the current step, pid
SUFFIX = ".busy"


class CoreShare:
    def __init__(self, directory: str | os.PathLike, name: str, cores: int, lease_s: float = 30.0,
                 rescan_s: float = 1.0) -> None:
        """cores: what all the workers of the directory share; lease_s: longer than any step (an
        8192-token float32 prefill step on 2 cores takes seconds); a dead process's claim ends
        at once anyway, so only a live worker that stopped stepping waits it out."""
        if cores < 1:
            raise ValueError("cores must be >= 1")
        self.dir, self.cores, self.lease_s, self.rescan_s = Path(directory), cores, lease_s, rescan_s
        self.dir.mkdir(parents=True, exist_ok=True)
        # who shares these cores, in words other processes compare (balancer/packing.py)
        self.group = f"{socket.gethostname()}:{self.dir.resolve()}"
        self._own_path = self.dir / f"{name}{SUFFIX}"
        self._own = os.open(self._own_path, os.O_RDWR | os.O_CREAT, 0o600)
        self._peers: dict[str, int] = {}  # file name -> fd
        self._scanned = -float("inf")

    def threads(self, busy: bool, now: float | None = None) -> int:
        """Mark this worker busy (or idle) and return the threads its next step may use: the cores
        // the workers with work, or 0 while busy peers still hold the cores it needs (ask again)."""
        now = time.monotonic() if now is None else now
        if not busy:
            self._write(0.0, 0)
            return 0
        if now - self._scanned >= self.rescan_s:
            self._rescan(now)
        peers = [(until, held) for until, held, pid in map(_read, self._peers.values())
                 if until > now and _alive(pid)]
        share = max(1, self.cores // (len(peers) + 1))
        free = self.cores - int(sum(held for _, held in peers))
        n = share if len(peers) >= self.cores else max(0, min(share, free))
        self._write(now + self.lease_s, n)
        return n

    def _write(self, until: float, threads: int) -> None:
        os.pwrite(self._own, _STATE.pack(until, float(threads), os.getpid()), 0)

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


def _read(fd: int) -> tuple[float, float, int]:
    data = os.pread(fd, _STATE.size, 0)
    return _STATE.unpack(data) if len(data) == _STATE.size else (0.0, 0.0, 0)


def _alive(pid: int) -> bool:
    """Whether a process of this pid exists (a SIGKILLed worker's file says busy until its lease)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        pass
    return True


def torch_pacer(share: CoreShare, wait_s: float | None = None, poll_s: float = 0.001) -> Callable[[bool], None]:
    """For the engine thread, before each step (busy) and while idle: sets its torch (OpenMP)
    threads to the share's answer when that changes; while the answer is 0 it waits for the peers'
    next steps (at most wait_s, default the lease, by which a silent peer's claim has lapsed; then
    it takes one thread: nothing may stop this worker for good)."""
    import torch  # the worker imports torch only for a real engine

    wait_s = share.lease_s if wait_s is None else wait_s

    def pace(busy: bool) -> None:
        n = share.threads(busy)
        if not busy:
            return
        deadline = time.monotonic() + wait_s
        while n == 0 and time.monotonic() < deadline:
            time.sleep(poll_s)
            n = share.threads(True)
        n = max(n, 1)
        if n != torch.get_num_threads():  # asked, not remembered: a rebuilt engine sets its own
            torch.set_num_threads(n)

    return pace
