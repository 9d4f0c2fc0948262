"""Real processes: the launcher starts nats-server + every service; workers die and requests survive."""
from __future__ import annotations

import asyncio
import re
import signal
import time

import aiohttp
import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY
from moebus.services.launcher import Stack, StackConfig
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.nats_server import free_port
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

CHAT = [{"role": "user", "content": "hi"}]
# One sequence at a time, 50 ms a token: requests queue up behind each other on each worker.
ENGINE = {"step_delay_s": 0.05, "max_num_seqs": 1}


@pytest.fixture
def stack(tmp_path):
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="toy", workers=2, heartbeat_interval_s=0.2,
                      engine=ENGINE, log_dir=str(tmp_path), ready_timeout_s=60)
    with Stack(cfg) as s:
        yield s


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


async def migrations(stack: Stack | str, kind: str = "") -> float:
    """Requests the frontend (of this stack, or at this URL) moved to another worker (of this kind:
    fresh / resumed)."""
    url = stack if isinstance(stack, str) else stack.url
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(v) for labels, v in re.findall(r"^moebus_frontend_migrations_total\{(.*)\} (\S+)$", text, re.M)
               if f'kind="{kind}"' in labels or not kind)


async def wait_accepted(stack: Stack, counts: dict[str, int], timeout: float = 10) -> None:
    """Until each worker has accepted at least counts[worker] requests (asked over NATS)."""
    bus = await Bus.connect(BusConfig(servers=[stack.nats_url], name="test"), Tracing("test"))
    deadline = time.monotonic() + timeout
    try:
        for worker, n in counts.items():
            while (await bus.request(Subjects().stats("worker", worker), Empty(), Stats, 2)).stats["accepted"] < n:
                assert time.monotonic() < deadline, f"{worker} did not get {n} requests"
                await asyncio.sleep(0.02)
    finally:
        await bus.drain()


async def test_killed_worker_loses_no_retryable_request(stack: Stack) -> None:
    c = client(stack)
    tasks = [asyncio.create_task(c.chat.completions.create(model="toy", messages=CHAT, max_tokens=8))
             for _ in range(6)]
    await wait_accepted(stack, {"worker-0": 3, "worker-1": 3})  # each: one running, two queued
    stack.kill("worker-0", signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 15)
    assert all(r.choices[0].message.content == TOY_REPLY[:8] for r in results)
    assert await migrations(stack, "fresh") == 3  # all of worker-0's requests were rerun on worker-1
    # Streams that had not started are retried too.
    streams = [await c.chat.completions.create(model="toy", messages=CHAT, max_tokens=4, stream=True)
               for _ in range(2)]
    texts = ["".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices]) for s in streams]
    assert texts == [TOY_REPLY[:4]] * 2


async def test_drained_worker_hands_back_its_queue(stack: Stack) -> None:
    c = client(stack)
    tasks = [asyncio.create_task(c.chat.completions.create(model="toy", messages=CHAT, max_tokens=8,
                                                           stream=bool(i % 2))) for i in range(6)]
    await wait_accepted(stack, {"worker-0": 3, "worker-1": 3})
    stack.kill("worker-0", signal.SIGTERM)  # graceful: finish the running one, hand back the queue
    results = await asyncio.wait_for(asyncio.gather(*tasks), 15)
    for r in results:
        if isinstance(r, openai.AsyncStream):
            assert "".join([ch.choices[0].delta.content or "" async for ch in r if ch.choices]) == TOY_REPLY[:8]
        else:
            assert r.choices[0].message.content == TOY_REPLY[:8]
    assert stack.procs["worker-0"].wait(10) == 0
