"""Migration on the real model, real processes: streams mid-flight when a worker is SIGKILLed go
on elsewhere and their greedy text is identical to the same stack's undisturbed run, with exactly
the undisturbed number of tokens (no duplicate, none missing). Aggregated (2 workers), and
disaggregated with the decode worker or the prefill worker killed (a prefill worker dying before
or during its KV hand-off)."""
from __future__ import annotations

import asyncio
import signal

import openai
import pytest

from moebus.services.launcher import Stack

from .conftest import real_model_stack
from .test_failover import migrations
from .test_migration_toy import Reader

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

pytest.importorskip("torch")
TOPICS = ["the sea", "a mountain", "the moon", "a city at night", "autumn leaves", "a river", "snow", "the desert",
          "a library", "a train", "the wind", "a garden"]
MAX_TOKENS = 24
ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 16, "max_model_len": 512}


def _messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write a short poem about {topic}."}]


async def _open(c: openai.AsyncOpenAI, topic: str) -> Reader:
    return Reader(await c.chat.completions.create(
        model="smollm2", messages=_messages(topic), max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "min_tokens": MAX_TOKENS}))


async def _kill_mid_stream(stack: Stack, victim: str, first_token_first: bool = True) -> None:
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)
    undisturbed = await asyncio.gather(*(_open(c, t) for t in TOPICS))
    reference = dict(zip(TOPICS, await asyncio.gather(*(s.rest() for s in undisturbed)), strict=True))
    opened = [await _open(c, t) for t in TOPICS]
    if first_token_first:  # every stream is past its first token when the worker dies
        await asyncio.gather(*(s.first() for s in opened))
    stack.kill(victim, signal.SIGKILL)
    done = await asyncio.wait_for(asyncio.gather(*(s.rest() for s in opened)), 240)
    for topic, s in zip(TOPICS, done, strict=True):
        assert s.text == reference[topic].text, topic
        assert s.usage.completion_tokens == reference[topic].usage.completion_tokens == MAX_TOKENS
    assert await migrations(stack) >= 1


@pytest.fixture
def agg(tmp_path_factory):
    yield from real_model_stack(tmp_path_factory, workers=2, worker={"torch_threads": 1}, engine=ENGINE,
                                ready_timeout_s=300)


async def test_aggregated_worker_killed_mid_stream(agg: Stack) -> None:
    await _kill_mid_stream(agg, "worker-1")
    assert await migrations(agg, "resumed") >= 1


@pytest.fixture
def disagg(tmp_path_factory):
    yield from real_model_stack(tmp_path_factory, mode="disaggregated", prefill_workers=1, decode_workers=2,
                                worker={"torch_threads": 1}, engine=ENGINE, ready_timeout_s=300)


async def test_disaggregated_decode_worker_killed_mid_stream(disagg: Stack) -> None:
    await _kill_mid_stream(disagg, "decode-0")
    assert await migrations(disagg, "resumed") >= 1


@pytest.fixture
def disagg_one_each(tmp_path_factory):
    yield from real_model_stack(tmp_path_factory, mode="disaggregated", prefill_workers=1, decode_workers=1,
                                worker={"torch_threads": 1}, engine=ENGINE, ready_timeout_s=300)


async def test_disaggregated_prefill_worker_killed_before_or_during_hand_off(disagg_one_each: Stack) -> None:
    # Killed as soon as the streams are sent: some wait for their prefill, some are between their
    # first token and the KV hand-off; they all finish on the one decode worker, which reports the
    # missing hand-off as the prefill worker's fault (excluding itself would leave no worker).
    await _kill_mid_stream(disagg_one_each, "prefill-0", first_token_first=False)
