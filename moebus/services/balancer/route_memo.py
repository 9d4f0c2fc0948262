"""A route asked again gets the first ask's answer, not a second worker running the request.

A frontend asks `balancer.route` again when no reply came in time: the balancer that took the first
ask may have been killed holding it, or the reply was lost in a bus blip, or the route is just slow
(a worker that times out before the next one takes it). The ask is repeated with the same request id
and attempt. Here a repeat that reaches the balancer still routing it waits for that route, and one
that comes after it answered gets the same GenerateAccepted, for `keep_s`. A repeat that reaches
another replica routes anew; the frontend aborts the request on any worker it did not keep
(frontend/routing/generation.py). A route that failed is forgotten: its repeat routes afresh.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from moebus.shared.messages import GenerateAccepted

Key = tuple[str, int]  # (request id, attempt)


class RouteMemo:
    def __init__(self, keep_s: float, on_repeat: Callable[[], object] = lambda: None, max_kept: int = 65536) -> None:
        self.keep_s, self.max_kept, self.on_repeat = keep_s, max_kept, on_repeat
        self._routing: dict[Key, asyncio.Future[GenerateAccepted]] = {}
        self._answered: OrderedDict[Key, tuple[float, GenerateAccepted]] = OrderedDict()  # oldest first

    async def once(self, key: Key, route: Callable[[], Awaitable[GenerateAccepted]]) -> GenerateAccepted:
        now = time.monotonic()
        self._forget(now)
        if (kept := self._answered.get(key)) is not None:
            self.on_repeat()
            return kept[1]
        if (running := self._routing.get(key)) is not None:
            self.on_repeat()
            return await asyncio.shield(running)  # (this ask's cancellation must not cancel the first's)
        fut: asyncio.Future[GenerateAccepted] = asyncio.get_running_loop().create_future()
        self._routing[key] = fut
        try:
            accepted = await route()
        except Exception as e:  # the repeats waiting on it get the same error
            fut.set_exception(e)
            fut.exception()  # (retrieved: no "never retrieved" warning when nobody repeated the ask)
            raise
        except BaseException:
            fut.cancel()
            raise
        else:
            fut.set_result(accepted)
            self._answered[key] = (time.monotonic() + self.keep_s, accepted)
            return accepted
        finally:
            del self._routing[key]

    def _forget(self, now: float) -> None:
        while self._answered and (len(self._answered) > self.max_kept or next(iter(self._answered.values()))[0] < now):
            self._answered.popitem(last=False)
