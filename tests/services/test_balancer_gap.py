"""A worker dropped from the balancer's table for missed beats while it still lives (its process
or the balancer's starved of CPU a moment: an in-process stack in CI lost its only worker so and
answered 503 "no live worker") is back with its next beat; a request in that gap waits for it."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from .conftest import HEARTBEAT, toy_stack


async def test_a_request_in_the_gap_waits_for_the_next_beat(nats_server) -> None:
    async with toy_stack(nats_server.url) as stack:
        for _ in range(3):
            assert stack.balancer.table.remove("worker-0")  # as the reaper drops a silent worker
            r = await stack.client().completions.create(model="toy", prompt="hi", max_tokens=4)
            assert r.choices[0].finish_reason == "length"
            await asyncio.sleep(HEARTBEAT)


async def test_with_no_worker_left_the_answer_is_still_a_prompt_503(nats_server) -> None:
    async with toy_stack(nats_server.url) as stack:
        await stack.workers[0].__aexit__(None, None, None)  # shut down: it beats no more
        stack.balancer.table.remove("worker-0")
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            await stack.client().completions.create(model="toy", prompt="hi", max_tokens=4)
        assert e.value.status_code == 503 and time.monotonic() - t0 < 1.5 * HEARTBEAT + 1.0
