"""Client disconnects abort the request on its worker; full queues answer 429/503 instead of hanging."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from .conftest import toy_stack, wait_for

CHAT = [{"role": "user", "content": "hi"}]
SLOW = {"step_delay_s": 0.03}  # the toy reply (~60 tokens) then takes ~2 s


async def test_cancelled_stream_aborts_and_frees_blocks(nats_server) -> None:
    async with toy_stack(nats_server.url, engine=SLOW) as stack:
        worker = stack.workers[0]
        stream = await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=200,
                                                              stream=True)
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        engine = worker._loop.stats
        assert engine["kv_blocks_free"] < engine["kv_blocks_total"], "the request holds KV blocks while running"
        await stream.close()  # the client goes away mid-stream
        await wait_for(lambda: worker.counters["aborted"] == 1)
        await stack.wait_idle()
        assert worker.counters["finished"] == 0
        assert worker._loop.stats["kv_blocks_free"] == worker._loop.stats["kv_blocks_total"]


async def test_non_stream_client_timeout_aborts(nats_server) -> None:
    async with toy_stack(nats_server.url, engine=SLOW) as stack:
        client = stack.client(timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=200)
        await wait_for(lambda: stack.workers[0].counters["aborted"] == 1)
        await stack.wait_idle()


async def test_full_queue_gives_429_fast(nats_server) -> None:
    engine = {"step_delay_s": 0.02, "max_num_seqs": 1}
    async with toy_stack(nats_server.url, engine=engine, worker={"max_queued": 1}) as stack:
        client = stack.client()

        async def one() -> int | str:
            try:
                r = await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=5)
                return r.choices[0].message.content
            except openai.RateLimitError as e:
                assert int(e.response.headers["Retry-After"]) >= 1
                assert e.body["code"] == "overloaded"
                return 429

        started = time.monotonic()
        results = await asyncio.gather(*(one() for _ in range(6)))
        assert 429 in results and "Hello" in results, results
        assert time.monotonic() - started < 10, "rejections must be immediate, not after a queue timeout"
        assert stack.workers[0].counters["rejected_overloaded"] == results.count(429)


async def test_no_worker_gives_503(nats_server) -> None:
    async with toy_stack(nats_server.url) as stack:
        await stack.workers[0].shutdown()
        await wait_for(lambda: len(stack.balancer.table.candidates("toy", time.monotonic())) == 0)
        with pytest.raises(openai.InternalServerError) as e:
            await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=5)
        assert e.value.status_code == 503 and e.value.response.headers["Retry-After"]


async def test_frontend_inflight_limit_gives_503(nats_server) -> None:
    async with toy_stack(nats_server.url, engine=SLOW, frontend={"max_inflight": 1}) as stack:
        client = stack.client()
        first = asyncio.create_task(client.chat.completions.create(model="toy", messages=CHAT, max_tokens=20))
        await wait_for(lambda: stack.workers[0].counters["accepted"] == 1)
        with pytest.raises(openai.InternalServerError) as e:
            await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=5)
        assert e.value.status_code == 503
        assert (await first).choices[0].finish_reason == "length"
