"""The whole stack as real processes on the real model (SmolLM2-135M), driven with the openai SDK."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from moebus.services.launcher import Stack
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .conftest import real_model_stack

pytest.importorskip("torch")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # dtype and weight format auto, as `./run up` has them (bf16 was where the README's question
    # was answered wrongly before the LM head's logits were float32; test_default_config.py runs it)
    yield from real_model_stack(tmp_path_factory, workers=1,
                                engine={"num_kv_blocks": 256, "max_num_seqs": 8, "dtype": "auto",
                                        "weight_format": "auto"},
                                ready_timeout_s=180)


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


async def worker_stats(stack: Stack) -> dict:
    bus = await Bus.connect(BusConfig(servers=[stack.nats_url], name="test"), Tracing("test"))
    try:
        return (await bus.request(Subjects().stats("worker", "worker-0"), Empty(), Stats, 5)).stats
    finally:
        await bus.drain()


async def test_chat_greedy_stream_equals_non_stream(stack: Stack) -> None:
    c = client(stack)
    r = await c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 12
    stream = await c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt: prefix cache hit


async def test_stop_string_and_logprobs(stack: Stack) -> None:
    c = client(stack)
    r = await c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0,
                                        stop=["Paris"], logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert "Paris" not in choice.message.content and choice.finish_reason == "stop"
    assert choice.logprobs.content and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    r = await c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3,
                                   temperature=0, logprobs=1)
    assert len(r.choices[0].logprobs.tokens) == 3 and r.choices[0].finish_reason == "length"


async def test_sampling_n_seed_and_json(stack: Stack) -> None:
    c = client(stack)
    r = await c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6, n=2, temperature=0.8,
                                        top_p=0.95, seed=3, frequency_penalty=0.3)
    assert len(r.choices) == 2 and r.usage.completion_tokens <= 12
    r = await c.chat.completions.create(
        model="smollm2", max_tokens=40, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with the key city set to Paris."}])
    content = r.choices[0].message.content.strip()
    assert content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


async def test_cancelled_stream_frees_kv_blocks(stack: Stack) -> None:
    c = client(stack)
    before = await worker_stats(stack)
    stream = await c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=200, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    n = 0
    async for _ in stream:
        n += 1
        if n == 3:
            break
    busy = await worker_stats(stack)
    assert busy["engine"]["kv_blocks_free"] < busy["engine"]["kv_blocks_total"]
    await stream.close()
    for _ in range(100):
        stats = await worker_stats(stack)
        if stats["aborted"] == before["aborted"] + 1 and stats["engine"]["num_running"] == 0:
            break
        await asyncio.sleep(0.05)
    assert stats["aborted"] == before["aborted"] + 1 and stats["active_requests"] == 0
    # Blocks of the aborted request are free again (the prefix cache may keep cached ones: they are evictable).
    assert stats["engine"]["kv_blocks_free"] >= before["engine"]["kv_blocks_free"]


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}}, "required": ["tz"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


async def test_named_tool_choice_is_constrained(stack: Stack) -> None:
    import jsonschema

    c = client(stack)
    named = await c.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=40, temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.slow  # constrained decoding on the real model: 20-40 s a request on a loaded 2-core box
async def test_required_tool_choice_streamed_is_constrained(stack: Stack) -> None:
    """The SDK's deltas put back together make calls that validate against their tool."""
    import jsonschema

    c = client(stack)
    stream = await c.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=60,
                                             temperature=0, tool_choice="required", parallel_tool_calls=False,
                                             stream=True)
    names, args, finish = {}, {}, None
    async for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.id:
                names[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and names
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for i, name in names.items():
        jsonschema.validate(json.loads(args[i]), schemas[name])


@pytest.mark.slow  # constrained decoding on the real model: 20-40 s a request on a loaded 2-core box
async def test_anthropic_messages_with_a_forced_tool(stack: Stack) -> None:
    import anthropic
    import jsonschema

    c = anthropic.AsyncAnthropic(base_url=stack.url, api_key="none", max_retries=0)
    m = await c.messages.create(model="smollm2", max_tokens=40, messages=ASK, extra_body={"temperature": 0},
                                tools=[{"name": "get_weather", "input_schema": WEATHER}],
                                tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
