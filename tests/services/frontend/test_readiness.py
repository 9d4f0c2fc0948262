"""Readiness that means ready (#19 item 5): /health is liveness, /ready turns 200 only once a worker
for each served model has warmed up (a warm-up generation before it reports ready); the small
endpoints (/ping, /version, /v1/models' max_model_len, /tokenize, /detokenize) in vLLM's shapes."""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiohttp

import moebus
from moebus.devmodel.toy import ToyEngine, ToyEngineConfig, ToyTokenizer
from moebus.services.worker import WorkerConfig, WorkerService

from ..conftest import HEARTBEAT, ToyStack, toy_stack, wait_for

CHAT = [{"role": "user", "content": "hi"}]


class _GatedEngine(ToyEngine):
    """The toy engine whose steps wait for `gate`: its warm-up holds until the test opens it."""

    def __init__(self, gate: threading.Event, steps: list[str]) -> None:
        super().__init__(ToyEngineConfig(step_delay_s=0.002))
        self.gate, self.steps = gate, steps

    def add_request(self, request_id: str, *a: Any, **kw: Any) -> None:
        self.steps.append(request_id)
        return super().add_request(request_id, *a, **kw)

    def step(self) -> Any:
        self.gate.wait(30)
        return super().step()


async def _get(http: aiohttp.ClientSession, path: str) -> tuple[int, Any]:
    async with http.get(path) as r:
        return r.status, await r.json(content_type=None)


async def test_ready_only_after_the_warm_up(nats_server) -> None:
    gate, seen = threading.Event(), []
    async with toy_stack(nats_server.url, workers=0) as stack, aiohttp.ClientSession(stack.base_url) as http:
        assert (await _get(http, "/health"))[0] == 200  # alive
        async with http.get("/ready") as r:
            status, body, retry = r.status, await r.json(), r.headers.get("Retry-After")
        assert status == 503 and body["models_without_workers"] == ["toy"] and retry == "1"
        assert body["error"] == {"message": "no ready worker serves 'toy'", "type": "service_unavailable",
                                 "param": None, "code": "unavailable"}
        async with http.post("/v1/chat/completions", json={"model": "toy", "messages": CHAT}) as r:
            assert r.status == 503 and "no live worker serves 'toy'" in (await r.json())["error"]["message"]
        cfg = WorkerConfig(model="toy", instance_id="worker-w", nats_url=stack.nats_url, subject_prefix=stack.prefix,
                           heartbeat_interval_s=HEARTBEAT)
        async with WorkerService(cfg, engine_factory=lambda: _GatedEngine(gate, seen)):
            await wait_for(lambda: bool(seen), timeout=10)  # the warm-up generation is in the engine
            await asyncio.sleep(5 * HEARTBEAT)  # heartbeats flow, but not ready ones
            assert seen[0].startswith("warmup-")
            assert (await _get(http, "/ready"))[0] == 503
            assert (await _get(http, "/health/ready"))[0] == 503
            gate.set()
            deadline = asyncio.get_running_loop().time() + 10
            while (await _get(http, "/ready"))[0] != 200:
                assert asyncio.get_running_loop().time() < deadline, "never ready"
                await asyncio.sleep(0.05)
            status, body = await _get(http, "/ready")
            assert body["workers"] == {"toy": ["worker-w"]} and body["models_without_workers"] == []
            assert body["status"] == "ready" and "error" not in body
            r = await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=3)
            assert r.choices[0].message.content == "Hel" and seen[1:] and not seen[1].startswith("warmup")
        deadline = asyncio.get_running_loop().time() + 10
        while (await _get(http, "/ready"))[0] != 503:  # its last beat said draining
            assert asyncio.get_running_loop().time() < deadline, "still ready with no worker"
            await asyncio.sleep(0.05)


async def test_small_endpoints(stack: ToyStack) -> None:
    async with aiohttp.ClientSession(stack.base_url) as http:
        assert (await _get(http, "/version")) == (200, {"version": moebus.__version__})
        async with http.get("/ping") as r:
            assert r.status == 200
        async with http.post("/ping") as r:
            assert r.status == 200
        models = await stack.client().models.list()
        assert [(m.id, m.max_model_len) for m in models.data] == [("toy", 8192)]
        tok = ToyTokenizer()
        async with http.post("/tokenize", json={"model": "toy", "prompt": "héllo"}) as r:
            body = await r.json()
        assert body == {"count": len(tok.encode("héllo")), "max_model_len": 8192, "tokens": tok.encode("héllo"),
                        "token_strs": None}
        async with http.post("/tokenize", json={"model": "toy", "messages": CHAT}) as r:
            chat = await r.json()
        assert chat["tokens"] == tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True))
        async with http.post("/detokenize", json={"model": "toy", "tokens": body["tokens"]}) as r:
            assert await r.json() == {"prompt": "héllo"}
        for path, bad, param in [("/tokenize", {"model": "toy"}, "prompt"),
                                 ("/tokenize", {"model": "toy", "prompt": "a", "return_token_strs": True},
                                  "return_token_strs"),
                                 ("/detokenize", {"model": "toy", "tokens": [10**6]}, "tokens"),
                                 ("/detokenize", {"model": "toy", "tokens": "abc"}, "tokens")]:
            async with http.post(path, json=bad) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == param, (path, bad)
        async with http.post("/tokenize", json={"model": "nope", "prompt": "a"}) as r:
            assert r.status == 404
