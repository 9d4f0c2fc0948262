"""WorkerConfig.engine_nice: the engine thread (and the compute threads it starts) runs at a lower
priority than the worker's event loop, so the bus and the other services run first when they wake
(the c=1 first token goes out while the next step computes)."""
from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from moebus.devmodel.toy import ToyEngine
from moebus.services.worker.config import WorkerConfig
from moebus.services.worker.engine_loop import EngineLoop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def _priorities(nice: int) -> tuple[int, int]:
    """(the engine thread's nice value, that of a thread it starts)."""
    loop = EngineLoop(ToyEngine, asyncio.get_running_loop(), lambda *a: None, lambda e: None, nice=nice)
    loop.start()
    try:
        assert await asyncio.to_thread(loop.ready.wait, 10)

        def probe(_engine: object) -> tuple[int, int]:
            child: list[int] = []
            t = threading.Thread(target=lambda: child.append(_priority()))
            t.start()
            t.join()
            return _priority(), child[0]
        return await loop.call(probe)
    finally:
        await asyncio.to_thread(loop.stop)


async def test_engine_thread_and_its_children_run_niced() -> None:
    base = _priority()
    if base > 16:
        pytest.skip("this process already runs at the bottom priority")
    assert await _priorities(3) == (base + 3, base + 3)
    assert await _priorities(0) == (base, base)  # off: as the process
    assert _priority() == base  # the caller's thread is untouched
    assert WorkerConfig().engine_nice == 0  # opt-in: it also yields to unrelated processes on the host
