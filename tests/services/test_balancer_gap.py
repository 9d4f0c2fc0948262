"""A worker dropped from the balancer's table for missed beats while it still lives (its process
or the balancer's starved of CPU a moment: an in-process stack in CI lost its only worker so and
answered 503 "no live worker") is back with its next beat; a request in that gap waits for it.
And the balancer's own stalls are not counted as a worker's silence, so such a drop should not
happen in the first place (a streamed response in CI lost its only worker mid-stream so)."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from moebus.shared.bus import Bus, BusConfig
from moebus.shared.messages import WorkerLost
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .conftest import HEARTBEAT, toy_stack


async def test_a_request_in_the_gap_waits_for_the_next_beat(nats_server) -> None:
    async with toy_stack(nats_server.url) as stack:
        for _ in range(3):
            assert stack.balancer.table.remove("worker-0")  # as the reaper drops a silent worker
            r = await stack.client().completions.create(model="toy", prompt="hi", max_tokens=4)
            assert r.choices[0].finish_reason == "length"
            await asyncio.sleep(HEARTBEAT)  # the next gap at another point of the beat cycle


async def test_with_no_worker_left_the_answer_is_still_a_prompt_503(nats_server) -> None:
    async with toy_stack(nats_server.url) as stack:
        await stack.workers[0].__aexit__(None, None, None)  # shut down: it beats no more
        stack.balancer.table.remove("worker-0")
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            await stack.client().completions.create(model="toy", prompt="hi", max_tokens=4)
        assert e.value.status_code == 503 and time.monotonic() - t0 < 1.5 * HEARTBEAT + 1.0


async def test_the_balancers_own_stall_is_no_workers_silence(nats_server) -> None:
    """The whole process stalls (balancer and worker share its loop, as in the in-process CI
    stacks) for longer than the worker's allowance of 3 beats; when it wakes, the reaper's timer
    may fire before the worker has sent its overdue beat. No worker may be announced lost, and
    every request still goes through. A worker that really stops beating is still dropped."""
    lost: list[str] = []
    bus = await Bus.connect(BusConfig(servers=[nats_server.url], name="test"), Tracing("test"))
    try:
        async with toy_stack(nats_server.url) as stack:
            async def on_lost(event: WorkerLost, _msg) -> None:
                lost.append(event.worker_id)
            await bus.subscribe(Subjects(stack.prefix).balancer_worker_lost, WorkerLost, on_lost)
            await bus.nc.flush()
            for _ in range(12):
                time.sleep(5 * HEARTBEAT)  # the loop blocked: nobody beats, nobody listens
                await asyncio.sleep(2 * HEARTBEAT)  # the overdue beats and the reaper's late round run now
                r = await stack.client().completions.create(model="toy", prompt="hi", max_tokens=4)
                assert r.choices[0].finish_reason == "length"
            await asyncio.sleep(4 * HEARTBEAT)  # past the reaper's 3 missed beats: still nobody lost
            assert lost == [], f"a live worker was announced lost after the balancer's own stall: {lost}"

            await stack.workers[0].__aexit__(None, None, None)  # it beats no more: dropped as before
            t0 = time.monotonic()
            while not lost and time.monotonic() - t0 < 20 * HEARTBEAT + 2:
                await asyncio.sleep(HEARTBEAT / 2)
            assert lost == ["worker-0"], f"a stopped worker was not dropped in time: {lost}"
    finally:
        await bus.drain()
