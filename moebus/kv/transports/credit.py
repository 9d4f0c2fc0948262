"""A receiver's KV credit: the bytes it lets be in flight towards it, shared by all its transfers.

A sender may put a chunk on the wire only out of a grant; the receiver grants from one pool per
receiving endpoint and returns a chunk's bytes to it once the chunk has left the NATS client's
buffer (stored in its transfer). So the bytes queued for one receiver (in nats-server's outbound
buffer for it, on the socket, in its subscription's pending queue) never exceed `capacity`,
however many transfers are under way: far below the server's MaxPending (64 MiB), the
receiver is never cut off as a slow consumer because of KV. Waiters are served in order
(FIFO): a large transfer is not starved by a stream of small ones.
"""
from __future__ import annotations

import asyncio
from collections import deque


class ByteCredits:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.free = capacity
        self.peak = 0  # the most bytes ever granted and not yet returned
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def in_flight(self) -> int:
        return self.capacity - self.free

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, n: int) -> int:
        """Wait until n bytes (at most `capacity`) are free, take them; returns what was taken."""
        n = max(1, min(n, self.capacity))
        if not self._waiters and self.free >= n:
            self._take(n)
            return n
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted just as we were cancelled: give it back
                self.release(n)
            else:
                self._waiters = deque(w for w in self._waiters if w[1] is not fut)
                self._wake()
            raise
        return n

    def release(self, n: int) -> None:
        self.free = min(self.capacity, self.free + n)
        self._wake()

    def _take(self, n: int) -> None:
        self.free -= n
        self.peak = max(self.peak, self.in_flight)

    def _wake(self) -> None:
        while self._waiters and self.free >= self._waiters[0][0]:
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._take(n)
                fut.set_result(None)
