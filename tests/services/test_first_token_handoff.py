"""WorkerConfig.first_token_handoff_ms: after a step that made a request's first token, the engine
thread waits (bounded) until the event loop says that token is on the bus before it starts the next
step, which would otherwise hold the cores the loop needs (c=1 TTFT, engine_loop.py)."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from moebus.devmodel.toy import ToyEngine
from moebus.services.worker.config import WorkerConfig
from moebus.services.worker.engine_loop import EngineLoop

PARAMS = SimpleNamespace(n=1, max_tokens=4, logprobs=None, structured=None)


async def _run(handoff_s: float, publish_s: float | None, requests: int = 2,
               hold_s: float = 0.0) -> tuple[list, list, list]:
    """Serve `requests` requests; the hand-off sets its event after publish_s (None: never).
    Returns (the steps' (start ns, request ids, end ns), hand-off calls, when each event was set (ns))."""
    steps: list[tuple[int, list[str]]] = []
    calls: list[int] = []
    set_at: list[int] = []
    done = asyncio.Event()
    finished: set[str] = set()

    def on_outputs(outputs, failed, prefilled, step) -> None:
        steps.append((step.started_ns, [o.request_id for o in outputs], step.ended_ns))
        finished.update(o.request_id for o in outputs if o.finished)
        if len(finished) == requests:
            done.set()

    def handoff(sent: threading.Event) -> None:
        calls.append(time.time_ns())
        if publish_s is not None:
            def publish() -> None:
                set_at.append(time.time_ns())
                sent.set()
            asyncio.get_running_loop().call_later(publish_s, publish)

    loop = EngineLoop(ToyEngine, asyncio.get_running_loop(), on_outputs, lambda e: None, handoff=handoff,
                      handoff_s=handoff_s, hold_s=hold_s)
    loop.start()
    try:
        assert await asyncio.to_thread(loop.ready.wait, 10)
        for i in range(requests):
            loop.add(f"r{i}", [1, 2, 3], PARAMS)
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await asyncio.to_thread(loop.stop)
    return steps, calls, set_at


async def test_the_next_step_waits_for_the_first_token_to_go_out() -> None:
    steps, calls, set_at = await _run(handoff_s=5.0, publish_s=0.2, requests=1)
    assert len(calls) == 1  # once per request: later tokens do not wait
    first = next(i for i, (_, rids, _) in enumerate(steps) if rids)
    assert len(steps) > first + 1
    assert steps[first + 1][0] >= set_at[0]  # the next step began only after the token was out


async def test_the_cores_stay_free_for_the_hold_after_the_token_went_out() -> None:
    steps, calls, set_at = await _run(handoff_s=5.0, publish_s=0.0, requests=1, hold_s=0.3)
    first = next(i for i, (_, rids, _) in enumerate(steps) if rids)
    assert set_at[0] < steps[first][2] + 0.3e9  # out before the hold ended: the hold alone kept the step back
    assert steps[first + 1][0] >= steps[first][2] + 0.3e9
    later = steps[first + 1:]
    assert all(b[0] - a[2] < 0.3e9 for a, b in zip(later, later[1:], strict=False))  # later tokens are not held


async def test_a_hand_off_that_never_comes_only_delays_by_the_bound() -> None:
    t0 = time.monotonic()
    steps, calls, _ = await _run(handoff_s=0.05, publish_s=None, requests=2)
    assert 1 <= len(calls) <= 2  # both first tokens may come from one step
    assert time.monotonic() - t0 < 10  # every request finished


async def test_off_at_zero() -> None:
    _, calls, _ = await _run(handoff_s=0.0, publish_s=0.2)
    assert calls == []
    assert WorkerConfig().first_token_handoff_ms > 0  # on by default
    assert WorkerConfig().first_token_hold_ms > 0


async def test_no_hold_when_the_batch_is_mostly_requests_past_their_first_token() -> None:
    """A new request joining a batch of older ones does not hold them (their next token would pay)."""
    steps: list[tuple[int, list[str], int]] = []
    joined = asyncio.Event()

    def on_outputs(outputs, failed, prefilled, step) -> None:
        steps.append((step.started_ns, [o.request_id for o in outputs], step.ended_ns))
        if sum("late" in s[1] for s in steps) >= 2:  # its first step and the one after
            joined.set()

    loop = EngineLoop(ToyEngine, asyncio.get_running_loop(), on_outputs, lambda e: None,
                      handoff=lambda sent: sent.set(), handoff_s=1.0, hold_s=0.5)
    loop.start()
    try:
        assert await asyncio.to_thread(loop.ready.wait, 10)
        long = SimpleNamespace(n=1, max_tokens=40, logprobs=None, structured=None)
        loop.add("a", [1, 2, 3], long)
        loop.add("b", [1, 2, 3], long)
        while len([s for s in steps if s[1]]) < 3:
            await asyncio.sleep(0.01)
        loop.add("late", [1, 2, 3], long)
        await asyncio.wait_for(joined.wait(), 10)
    finally:
        await asyncio.to_thread(loop.stop)
    first_ab = next(i for i, s in enumerate(steps) if s[1])
    assert steps[first_ab + 1][0] - steps[first_ab][2] >= 0.5e9  # a and b's first tokens: the whole step, held
    late = next(i for i, s in enumerate(steps) if "late" in s[1])
    assert len(steps[late][1]) == 3
    assert steps[late + 1][0] - steps[late][2] < 0.3e9  # 1 first token of 3: not held
