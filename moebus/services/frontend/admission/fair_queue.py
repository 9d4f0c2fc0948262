"""FairQueue: a bounded capacity (generations and their tokens) shared by flows (tenants).

While there is room a request starts at once; once full, requests wait and start, as room comes
back, in order of a start tag: start-time fair queueing (Goyal et al., SFQ) on tokens. A flow's
request gets start = max(V, the flow's last finish) and finish = start + tokens / weight; V is the
start tag of the request started last. A flow that sends much gets tags far ahead of V, a flow
that was idle starts at V: it goes ahead of the busy flow's backlog and waits at most for the
next free room, and under contention flows get tokens in proportion to their weights. Idle time
banks no credit (the max with V). Tags are taken on arrival, so a flow's requests keep their order.
The head waits until it fits: a large request is never starved by smaller ones behind it. A
request larger than the whole token capacity starts alone when nothing runs.

fair=False is the baseline: tags are arrival numbers (first come, first served).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(order=True, slots=True)
class _Waiter:
    start: float
    seq: int
    finish: float = field(compare=False)
    flow: str = field(compare=False)
    tokens: int = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)


class FairQueue:
    def __init__(self, max_running: int | None, max_tokens: int | None, fair: bool = True) -> None:
        self.max_running, self.max_tokens, self.fair = max_running, max_tokens, fair
        self.running = 0  # started and not released
        self.running_tokens = 0
        self._vtime = 0.0  # V: the start tag of the request started last
        self._finish: dict[str, float] = {}  # per flow: the finish tag of its last request
        self._heap: list[_Waiter] = []
        self.waiting = 0  # in the heap and still waiting
        self._seq = itertools.count()

    async def acquire(self, flow: str, tokens: int, weight: float = 1.0, timeout: float | None = None) -> None:
        """Until the request may start; TimeoutError after `timeout` seconds of waiting. Every
        return must be paired with a release(tokens)."""
        seq = next(self._seq)
        start = max(self._vtime, self._finish.get(flow, 0.0)) if self.fair else float(seq)
        finish = start + tokens / weight
        w = _Waiter(start, seq, finish, flow, tokens, asyncio.get_running_loop().create_future())
        if self.fair:
            self._finish[flow] = finish
        heapq.heappush(self._heap, w)
        self.waiting += 1
        self._dispatch()
        if w.future.done():
            return
        try:
            async with asyncio.timeout(timeout):
                await w.future
        except BaseException:
            if w.future.done() and not w.future.cancelled():  # started just as it gave up: hand it back
                self.release(tokens)
            else:
                w.future.cancel()
                self.waiting -= 1
                if self._finish.get(flow) == finish:  # its flow's last: forget its share
                    self._finish[flow] = start
                self._dispatch()  # it may have been the head that did not fit
            raise

    def release(self, tokens: int) -> None:
        self.running -= 1
        self.running_tokens -= tokens
        self._dispatch()

    def _fits(self, tokens: int) -> bool:
        if self.max_running is not None and self.running >= self.max_running:
            return False
        return self.max_tokens is None or self.running == 0 or self.running_tokens + tokens <= self.max_tokens

    def _take(self, w: _Waiter) -> None:
        self.running += 1
        self.running_tokens += w.tokens
        if self.fair:
            self._vtime = max(self._vtime, w.start)

    def _dispatch(self) -> None:
        while self._heap:
            w = self._heap[0]
            if w.future.done():  # gave up
                heapq.heappop(self._heap)
            elif self._fits(w.tokens):
                heapq.heappop(self._heap)
                self.waiting -= 1
                self._take(w)
                w.future.set_result(None)
            else:
                return
