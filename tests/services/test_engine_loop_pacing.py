"""The worker's engine loop and the core share's pacer (platforms/cpu/core_share.py): the loop asks
before every step, on its own thread, and says when it has gone idle."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from moebus.devmodel.toy import ToyEngine
from moebus.services.worker.engine_loop import EngineLoop


async def test_the_engine_loop_paces_each_step_and_says_when_idle() -> None:
    calls: list[tuple[bool, str]] = []
    done = asyncio.Event()

    def on_outputs(outputs, failed, prefilled, step) -> None:
        if any(o.finished for o in outputs):
            done.set()

    times: list[float] = []

    def pace(busy: bool) -> None:
        calls.append((busy, threading.current_thread().name))
        times.append(time.monotonic())

    loop = EngineLoop(ToyEngine, asyncio.get_running_loop(), on_outputs, lambda e: None, pace=pace)
    loop.start()
    try:
        assert await asyncio.to_thread(loop.ready.wait, 10)
        loop.add("r0", [1, 2, 3], SimpleNamespace(n=1, max_tokens=3, logprobs=None, structured=None))
        await asyncio.wait_for(done.wait(), 10)
        finished = time.monotonic()
        for _ in range(200):  # the loop goes idle after the last step
            if calls and not calls[-1][0] and any(busy for busy, _ in calls):
                break
            await asyncio.sleep(0.01)
        busy = [b for b, _ in calls]
        assert busy.count(True) >= 3, calls  # one a step: 3 tokens
        assert busy[0] is False and busy[-1] is False, calls  # idle before the request and after it
        last_busy = max(i for i, b in enumerate(busy) if b)
        # the claim is dropped before the idle thread sleeps (up to 0.5 s), not after: a peer waits on it
        assert times[last_busy + 1] - finished < 0.2, (times[last_busy + 1] - finished)
        assert {name for _, name in calls} == {"moebus-engine"}
    finally:
        await asyncio.to_thread(loop.stop)
