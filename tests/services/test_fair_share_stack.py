"""Fair capacity through the whole stack (issue 36 item 5), real model, real processes: one
/v1/completions call at the frontend's limits (64 prompts x n=16 = 1024 sequences) beside another
user's short chat requests. With each call's share of a worker's batch capped (the default,
max_owner_share 0.5) the other user's TTFT stays near an idle stack's; uncapped (1.0) it waits
behind the big call (the issue measured 28 s). `-s` prints both (RELIABILITY.md)."""
from __future__ import annotations

import asyncio
import statistics
import time

import openai
import pytest

from .conftest import real_model_stack

pytestmark = pytest.mark.slow
BIG_PROMPTS, BIG_N, BIG_TOKENS = 64, 16, 16


async def _ttft(client: openai.AsyncOpenAI) -> float:
    started = time.monotonic()
    stream = await client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi!"}],
                                                  max_tokens=4, stream=True)
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - started
    return first


async def _beside_the_big_call(url: str) -> tuple[list[float], float]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    prompts = [f"Count from {i} to {i + 20}:" for i in range(BIG_PROMPTS)]
    started = time.monotonic()
    big = asyncio.create_task(client.completions.create(model="smollm2", prompt=prompts, n=BIG_N,
                                                        max_tokens=BIG_TOKENS, temperature=0))
    await asyncio.sleep(3.0)  # the big call fills both workers' batches
    ttfts = []
    for _ in range(5):
        ttfts.append(await _ttft(client))
        await asyncio.sleep(0.5)  # probes spread over the big call
    r = await big
    assert len(r.choices) == BIG_PROMPTS * BIG_N
    return ttfts, time.monotonic() - started


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_other_users_ttft_beside_a_1024_sequence_call(tmp_path_factory, share: float) -> None:
    for stack in real_model_stack(tmp_path_factory, workers=2, worker={"torch_threads": 1},
                                  engine={"max_owner_share": share}, ready_timeout_s=300):
        idle = asyncio.run(_idle(stack.url))
        ttfts, big_s = asyncio.run(_beside_the_big_call(stack.url))
        print(f"\nmax_owner_share {share}: other user's TTFT idle {idle:.2f}s, beside the 64x16 call "
              f"p50 {statistics.median(ttfts):.2f}s max {max(ttfts):.2f}s; the big call took {big_s:.1f}s")
        if share < 1.0:
            assert statistics.median(ttfts) < 2.0, ttfts


async def _idle(url: str) -> float:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    return statistics.median([await _ttft(client) for _ in range(3)])
