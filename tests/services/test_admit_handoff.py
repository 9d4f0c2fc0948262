"""WorkerConfig.admit_handoff_ms: a request added while the engine thread sleeps on an empty queue
makes the event loop wait (bounded, the GIL released) until the thread has woken with it, so the
thread starts on it at once rather than when the loop next goes idle (c=1 TTFT, engine_loop.py)."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from moebus.devmodel.toy import ToyEngine
from moebus.services.worker.config import WorkerConfig
from moebus.services.worker.engine_loop import EngineLoop

PARAMS = SimpleNamespace(n=1, max_tokens=2, logprobs=None, structured=None)


async def _loop(admit_s: float, engine=ToyEngine) -> tuple[EngineLoop, asyncio.Event]:
    done = asyncio.Event()

    def on_outputs(outputs, failed, prefilled, step) -> None:
        if any(o.finished for o in outputs):
            done.set()

    loop = EngineLoop(engine, asyncio.get_running_loop(), on_outputs, lambda e: None, admit_s=admit_s)
    loop.start()
    assert await asyncio.to_thread(loop.ready.wait, 10)
    for _ in range(200):  # until the idle thread sleeps on the queue
        if loop._asleep:
            break
        await asyncio.sleep(0.01)
    assert loop._asleep
    return loop, done


async def test_an_add_to_a_sleeping_engine_returns_once_the_thread_took_it() -> None:
    loop, done = await _loop(admit_s=5.0)
    try:
        loop.add("r0", [1, 2, 3], PARAMS)
        assert loop._cmds.empty()  # the engine thread already has the request
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await asyncio.to_thread(loop.stop)


async def test_off_at_zero_the_add_only_queues() -> None:
    loop, done = await _loop(admit_s=0.0)
    try:
        loop.add("r0", [1, 2, 3], PARAMS)
        assert not loop._cmds.empty()  # this thread holds the GIL: the engine thread cannot have taken it
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await asyncio.to_thread(loop.stop)


class _SlowStep(ToyEngine):
    """A toy engine whose steps block until released: the thread is busy, not asleep."""

    release = threading.Event()

    def step(self):
        _SlowStep.release.wait(10)
        return super().step()


async def test_an_add_while_the_engine_steps_does_not_wait() -> None:
    loop, done = await _loop(admit_s=5.0, engine=_SlowStep)
    try:
        loop.add("r0", [1, 2, 3], PARAMS)
        for _ in range(200):  # its step has begun (and blocks)
            if not loop._asleep and loop._cmds.empty():
                break
            await asyncio.sleep(0.01)
        waits: list[float | None] = []
        loop._woke.wait = waits.append  # type: ignore[method-assign]
        loop.add("r1", [4, 5, 6], PARAMS)
        assert waits == []  # no wait: the thread is stepping, it takes the request after this step
    finally:
        _SlowStep.release.set()
        await asyncio.wait_for(done.wait(), 10)
        await asyncio.to_thread(loop.stop)


def test_the_default_waits_two_ms() -> None:
    assert WorkerConfig().admit_handoff_ms == 2.0
