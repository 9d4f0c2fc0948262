"""Parallel migration (issue 36 item 3), on `Stack` (real processes): a worker SIGKILLed with ten
streams on it; they move to the other worker as suspects, run there as one batch (not one by one,
worker/quarantine.py) and end within a few steps of each other, each with the whole reply."""
from __future__ import annotations

import asyncio
import signal

import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY
from moebus.services.launcher import Stack

from .test_bus_blips import STEP_S, STREAMS, Stream, run_stream, stream_stack
from .test_failover import migrations

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

SPREAD_S = 10 * STEP_S  # the moved streams' ends: a few steps apart at most (one by one: ~5 s each)


@pytest.fixture
def stack(tmp_path):
    with Stack(stream_stack(str(tmp_path))) as s:
        yield s


async def test_streams_of_a_killed_worker_resume_together(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)
    streams = [Stream() for _ in range(STREAMS)]
    tasks = [asyncio.create_task(run_stream(client, s)) for s in streams]
    while not all(len(s.times) >= 3 for s in streams):
        await asyncio.sleep(0.02)
    stack.kill("worker-0", signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*tasks), 90)
    assert [s.text for s in streams] == [TOY_REPLY] * STREAMS  # none lost, nothing repeated or missing
    moved = [s for s in streams if max(b - a for a, b in zip(s.times, s.times[1:], strict=False)) > 0.5]
    ends = sorted(s.ended for s in moved)
    print(f"\n{len(moved)} streams moved; their ends spread over {ends[-1] - ends[0]:.2f}s")
    assert len(moved) >= 5 and await migrations(stack, "resumed") >= len(moved)
    assert ends[-1] - ends[0] < SPREAD_S, f"moved streams ended {ends[-1] - ends[0]:.2f}s apart"
