"""Tenants on the toy stack: keys, 401/429, budgets refunded, priorities reaching the engine, and a
flooding tenant that cannot hold back another tenant's first tokens (docs/tenants.md)."""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import aiohttp
import openai
import pytest

from moebus.devmodel.toy import ToyEngine, ToyEngineConfig
from moebus.services.frontend.admission.tenants import add_key
from moebus.services.frontend.config import TenantLimits

from .conftest import toy_stack

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

CHAT = [{"role": "user", "content": "hi"}]


async def _metrics(http: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with http.get(base + "/metrics") as r:
        text = await r.text()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("moebus_frontend_tenant_")}


async def _complete(http: aiohttp.ClientSession, base: str, key: str, max_tokens: int,
                    streaming: asyncio.Event | None = None) -> tuple[int, float | None]:
    """Stream one completion to its end: (status, seconds to the first token); `streaming` is set at it."""
    t0 = time.monotonic()
    body = {"model": "toy", "prompt": "hi", "max_tokens": max_tokens, "stream": True}
    async with http.post(base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"text":""' not in line:
                first = time.monotonic() - t0
                if streaming is not None:
                    streaming.set()
        return r.status, first


@pytest.fixture
def keys(tmp_path) -> dict[str, str]:
    path = tmp_path / "keys.json"
    return {"file": str(path), "a": add_key(path, "a"), "b": add_key(path, "b")}


async def test_keys_rate_and_budget(nats_server, tmp_path) -> None:
    path = tmp_path / "keys.json"
    slow = add_key(path, "slow", TenantLimits(rate=0.5, burst=2))
    tight = add_key(path, "tight", TenantLimits(max_tokens_in_flight=150))
    frontend = {"keys_file": str(path), "api_keys": ["sk-legacy"]}
    async with toy_stack(nats_server.url, frontend=frontend, engine={"step_delay_s": 0.02}) as stack, \
            aiohttp.ClientSession() as http:
        with pytest.raises(openai.AuthenticationError):
            await stack.client("sk-wrong").chat.completions.create(model="toy", messages=CHAT, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            await stack.client(tight[:-1]).chat.completions.create(model="toy", messages=CHAT, max_tokens=2)
        r = await stack.client("sk-legacy").chat.completions.create(model="toy", messages=CHAT, max_tokens=2)
        assert r.choices[0].message.content == "He"

        for _ in range(2):  # the burst
            await stack.client(slow).completions.create(model="toy", prompt="hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as e:
            await stack.client(slow).completions.create(model="toy", prompt="hi", max_tokens=1)
        assert e.value.body["code"] == "rate_limit_exceeded" and int(e.value.response.headers["Retry-After"]) >= 1

        # tight: 150 tokens in flight; each request holds 2 (prompt) + 60 (max_tokens)
        streaming = [asyncio.Event() for _ in range(2)]
        running = [asyncio.create_task(_complete(http, stack.base_url, tight, 60, s)) for s in streaming]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in streaming)), 10)
        with pytest.raises(openai.RateLimitError) as e:
            await stack.client(tight).completions.create(model="toy", prompt="hi", max_tokens=60)
        assert e.value.body["code"] == "tokens_in_flight_exceeded" and e.value.response.headers["Retry-After"]
        m = await _metrics(http, stack.base_url)
        assert m['moebus_frontend_tenant_tokens_in_flight{tenant="tight"}'] == 124
        assert [s for s, _ in await asyncio.gather(*running)] == [200, 200]
        with pytest.raises(openai.BadRequestError):  # can never fit: retrying would not help
            await stack.client(tight).completions.create(model="toy", prompt="hi", max_tokens=200)

        # a client that goes away mid-stream hands its tokens back too
        streaming = asyncio.Event()
        task = asyncio.create_task(_complete(http, stack.base_url, tight, 60, streaming))
        await asyncio.wait_for(streaming.wait(), 10)
        task.cancel()
        await stack.wait_idle()
        m = await _metrics(http, stack.base_url)
        assert m['moebus_frontend_tenant_tokens_in_flight{tenant="tight"}'] == 0
        assert m['moebus_frontend_tenant_rejected_total{reason="budget",tenant="tight"}'] == 1
        assert m['moebus_frontend_tenant_rejected_total{reason="rate",tenant="slow"}'] == 1
        assert m['moebus_frontend_tenant_admitted_total{tenant="tight"}'] == 3
        assert m['moebus_frontend_tenant_admitted_total{tenant="default"}'] == 1


class _Recording(ToyEngine):
    def __init__(self, seen: list[int]) -> None:
        super().__init__(ToyEngineConfig(step_delay_s=0.002))
        self.seen = seen

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: object, priority: int = 0,
                    **kw: object) -> None:
        if not request_id.startswith("warmup-"):  # the worker's own, before it is ready
            self.seen.append(priority)
        return super().add_request(request_id, prompt_token_ids, params, priority, **kw)


async def test_tenant_priority_reaches_the_engine(nats_server, tmp_path) -> None:
    path = tmp_path / "keys.json"
    urgent = add_key(path, "urgent", TenantLimits(priority=-5))
    batch = add_key(path, "batch", TenantLimits(priority=3))
    seen: list[int] = []
    async with toy_stack(nats_server.url, frontend={"keys_file": str(path)},
                         engine_factory=lambda: _Recording(seen)) as stack:
        for key in (urgent, batch):
            await stack.client(key).completions.create(model="toy", prompt="hi", max_tokens=1)
    assert seen == [-5, 3]


# --- flood ---------------------------------------------------------------------------------
STEP_S = 0.01  # the toy engine's step: a token per running request every 10 ms
SLOTS = 8  # its batch (max_num_seqs); the frontend starts at most this many at once
FLOOD = 32  # tenant A's concurrent requests, each up to A_MAX_TOKENS long
A_MAX_TOKENS = 50
B_REQUESTS = 12


async def _flood_ttft(nats_url: str, keys: dict[str, str], admission: dict | None, flood: bool) -> list[float]:
    """Tenant B's TTFTs (B sends one short request at a time) while A keeps FLOOD long ones in flight."""
    frontend = {"keys_file": keys["file"], "admission": admission or {}}
    async with toy_stack(nats_url, frontend=frontend, engine={"step_delay_s": STEP_S, "max_num_seqs": SLOTS}) as stack, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        stop, rng = asyncio.Event(), random.Random(0)

        async def flooder() -> None:
            while not stop.is_set():
                await _complete(http, stack.base_url, keys["a"], rng.randint(A_MAX_TOKENS // 2, A_MAX_TOKENS))

        flooders = [asyncio.create_task(flooder()) for _ in range(FLOOD if flood else 0)]
        await asyncio.sleep(1.0 if flood else 0)  # the backlog builds
        ttfts = []
        for _ in range(B_REQUESTS):
            status, first = await _complete(http, stack.base_url, keys["b"], 4)
            assert status == 200 and first is not None
            ttfts.append(first)
            await asyncio.sleep(0.05)  # b's requests apart, each into the flood's backlog
        stop.set()
        await asyncio.gather(*flooders)
        return ttfts


def _p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20, method="inclusive")[-1]


async def test_a_flooding_tenant_cannot_hold_back_another(nats_server, keys) -> None:
    capacity = {"max_running": SLOTS}
    alone = await _flood_ttft(nats_server.url, keys, capacity, flood=False)
    fair = await _flood_ttft(nats_server.url, keys, {**capacity, "fair_share": True}, flood=True)
    fifo = await _flood_ttft(nats_server.url, keys, {**capacity, "fair_share": False}, flood=True)
    figures = {name: {"p50_ms": round(statistics.median(x) * 1000), "p95_ms": round(_p95(x) * 1000)}
               for name, x in (("b_alone", alone), ("b_fair", fair), ("b_first_come", fifo))}
    print("\nflood TTFT of tenant B:", json.dumps(figures))
    # The bound: B waits at most for the next free slot, i.e. for one of A's requests to end
    # (A_MAX_TOKENS steps), beyond its TTFT alone; first come it waits for A's whole backlog.
    one_request = A_MAX_TOKENS * STEP_S
    assert _p95(fair) <= _p95(alone) + 1.5 * one_request, figures
    assert _p95(fifo) >= 2 * _p95(fair), figures
