"""KV features of the running stack, as real processes on SmolLM2 through the openai SDK:
prefill/decode split, prefix-cache TTFT, KV-aware routing, a killed KV broker."""
from __future__ import annotations

import asyncio
import signal
import time

import openai
import pytest

from moebus.services.launcher import Stack, StackConfig
from moebus.shared.nats_server import free_port

from .conftest import service_stats

pytest.importorskip("torch")
HEARTBEAT = 0.25
QUESTIONS = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Name three colours of the rainbow."}]]
LONG = "Paged attention keeps the keys and values of every sequence in fixed-size blocks. " * 12


def _stack(tmp_path_factory, **kw) -> Stack:
    try:
        from moebus.text.gguf import embedded_gguf_path

        embedded_gguf_path()
    except Exception:
        pytest.skip("the embedded SmolLM2 GGUF is not available")
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="smollm2", heartbeat_interval_s=HEARTBEAT,
                      engine={"num_kv_blocks": 256, "max_num_seqs": 8}, worker={"torch_threads": 1},
                      ready_timeout_s=180, log_dir=str(tmp_path_factory.mktemp("logs")), **kw)
    return Stack(cfg)


@pytest.fixture(scope="module")
def agg(tmp_path_factory):
    with _stack(tmp_path_factory, workers=2) as s:
        yield s


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    with _stack(tmp_path_factory, mode="disaggregated", prefill_workers=1, decode_workers=1) as s:
        yield s


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


async def picks(stack: Stack) -> dict[str, int]:
    return (await service_stats(stack, "balancer", "balancer-0"))["picks"]


async def greedy(c: openai.AsyncOpenAI, messages: list[dict], stream: bool, max_tokens: int = 16) -> str:
    if not stream:
        r = await c.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content
    s = await c.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0,
                                        stream=True)
    return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])


async def test_disaggregated_gives_the_aggregated_tokens(agg: Stack, disagg: Stack) -> None:
    for q in QUESTIONS:
        want = await greedy(client(agg), q, stream=False)
        assert want
        assert await greedy(client(disagg), q, stream=False) == want
        assert await greedy(client(disagg), q, stream=True) == want
    pre, dec = await service_stats(disagg, "worker", "prefill-0"), await service_stats(disagg, "worker", "decode-0")
    assert pre["handed_off"] >= 4 and pre["kv"]["kv_sent"] >= 4
    assert dec["kv"]["kv_received"] >= 4 and dec["kv"]["kv_receive_failed"] == 0


async def _ttft(c: openai.AsyncOpenAI, prompt: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    s = await c.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                   stream_options={"include_usage": True})
    ttft, cached = None, 0
    async for ch in s:
        if ttft is None and ch.choices and ch.choices[0].text:
            ttft = time.perf_counter() - t0
        if ch.usage is not None and ch.usage.prompt_tokens_details is not None:
            cached = ch.usage.prompt_tokens_details.cached_tokens or 0
    return ttft, cached


@pytest.mark.parametrize("which", ["agg", "disagg"])
async def test_repeated_long_prompt_is_served_from_the_cache(which: str, request) -> None:
    c = client(request.getfixturevalue(which))
    prompt = f"{which}: {LONG}"
    stack = request.getfixturevalue(which)
    held = await indexed_blocks(stack)
    first, cached0 = await _ttft(c, prompt)
    await _indexed_more(stack, held)  # the balancer routes the repeat to the cache holding it
    second, cached1 = await _ttft(c, prompt)
    print(f"\n{which}: TTFT first {first * 1000:.0f} ms (cached {cached0}), "
          f"second {second * 1000:.0f} ms (cached {cached1})")
    assert cached0 == 0 and cached1 > 0
    assert second < first


async def indexed_blocks(stack: Stack) -> dict[str, int]:
    """Blocks the balancer's own prefix index holds per worker (what it routes by)."""
    return (await service_stats(stack, "balancer", "balancer-0"))["kv"]["holders"]


async def _indexed_more(stack: Stack, held: dict[str, int], worker: str | None = None) -> None:
    """Until the balancer's index holds more blocks of `worker` (any worker) than `held`."""
    deadline = time.monotonic() + 20
    while True:
        now = await indexed_blocks(stack)
        if any(now.get(w, 0) > held.get(w, 0) for w in ([worker] if worker else now)):
            return
        assert time.monotonic() < deadline, "the worker's cached prefix never reached the balancer's index"
        await asyncio.sleep(HEARTBEAT / 2)


async def test_routing_follows_the_cache(agg: Stack) -> None:
    c = client(agg)
    prompt = "Routing follows the cache: " + LONG
    before, held = await picks(agg), await indexed_blocks(agg)
    await c.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0)
    after = await picks(agg)
    (home,) = [w for w in after if after[w] > before.get(w, 0)]
    # Route only once the prefix reached the balancer's index (its KV events): an event, not a sleep.
    await _indexed_more(agg, held, home)
    for i in range(3):
        await c.completions.create(model="smollm2", prompt=f"{prompt} Question {i}: why?", max_tokens=2,
                                   temperature=0)
    full = await service_stats(agg, "balancer", "balancer-0")
    now = full["picks"]
    assert now[home] == after[home] + 3, (after, now, full["kv"], full["workers"])
    # Under load, other prompts spread over both workers.
    others = [c.completions.create(model="smollm2", prompt=f"Unrelated prompt number {i}. " * 8, max_tokens=8,
                                   temperature=0) for i in range(4)]
    await asyncio.gather(*others)
    full = await service_stats(agg, "balancer", "balancer-0")
    spread = full["picks"]
    assert all(spread[w] > now.get(w, 0) for w in spread), (now, spread, full["workers"])


async def test_killed_kv_broker_loses_no_request(agg: Stack, disagg: Stack) -> None:
    for stack in (agg, disagg):
        stack.kill("kvbroker-0", signal.SIGKILL)
        stack.procs["kvbroker-0"].wait(10)
    q = QUESTIONS[0]
    want = await greedy(client(agg), q, stream=False)
    results = await asyncio.gather(*[greedy(client(s), q, stream=st) for s in (agg, disagg) for st in (False, True)],
                                   client(agg).completions.create(model="smollm2", prompt="KV broker gone. " + LONG,
                                                                  max_tokens=4, temperature=0))
    assert results[:4] == [want] * 4
    assert results[4].choices[0].finish_reason == "length"
