"""Edge limits past the fields (#20 item 5): JSON nesting, slow headers and bodies (slow-loris),
concurrent requests per client. Each is a clear 4xx (or, for headers too slow to answer, a closed
connection), and the stack serves normally right after with every KV block free.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from pydantic import ValidationError

from moebus.services.frontend.api.openapi import openapi_document
from moebus.services.frontend.config import RequestLimits

from .conftest import ToyStack, toy_stack, wait_for

CHAT = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LIMITS = {"header_timeout_s": 1.0, "body_timeout_s": 1.0}


@pytest.fixture
async def edge(nats_server) -> AsyncIterator[ToyStack]:
    async with toy_stack(nats_server.url, engine={"step_delay_s": 0.03},
                         frontend={"limits": LIMITS, "max_concurrent_per_client": 2}) as s:
        yield s


def _session() -> aiohttp.ClientSession:
    # No pooled connections: the 1 s header timeout closes idle ones, which a reused one would race.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def _post(stack: ToyStack, body: bytes | dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with _session() as http, http.post(stack.base_url + path, data=data) as r:
        return r.status, await r.json()


async def _still_serves(stack: ToyStack) -> None:
    status, body = await _post(stack, CHAT)
    assert status == 200 and body["choices"][0]["message"]["content"] == "He", body
    await stack.wait_idle()


def _nested(depth: int) -> bytes:
    """A chat body whose ignored `extra` field makes the whole body `depth` levels deep."""
    inner = depth - 1  # the body object is level 1
    return json.dumps(CHAT)[:-1].encode() + b', "extra": ' + b"[" * inner + b"]" * inner + b"}"


async def test_json_nesting_cap(edge: ToyStack) -> None:
    status, _ = await _post(edge, _nested(128))  # at the cap (the extra field is ignored)
    assert status == 200
    for depth in (129, 1000, 1025, 100_000):  # over the cap; 1025 and more: past orjson's own limit too
        status, body = await _post(edge, _nested(depth))
        err = body["error"]
        assert status == 400 and err["code"] == "invalid_json" and err["type"] == "invalid_request_error", body
        assert err["param"] == "extra" and "nests deeper than 128" in err["message"] if depth <= 1024 \
            else "depth limit exceeded" in err["message"], err
    # NaN sends the body through the standard library's parser, which recurses: still a 400.
    status, body = await _post(edge, _nested(900)[:-1] + b', "temperature": NaN}')
    assert status == 400, body
    status, body = await _post(edge, {**CHAT, "messages": [{"role": "user", "content": [[[[[["x"]]]]]]}]})
    assert status == 400 and body["error"]["param"].startswith("messages.0.content"), body
    await _still_serves(edge)


def test_json_depth_leaves_room_for_a_schema() -> None:
    RequestLimits(max_json_depth=67, max_schema_depth=64)
    with pytest.raises(ValidationError, match="max_json_depth must be >= max_schema_depth"):
        RequestLimits(max_json_depth=66, max_schema_depth=64)
    with pytest.raises(ValidationError):
        RequestLimits(max_json_depth=2000)  # orjson refuses past 1024 anyway


async def _raw(stack: ToyStack) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = stack.base_url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def test_slow_headers_are_cut_off(edge: ToyStack) -> None:
    """A client trickling its request head (slow-loris) loses the connection at header_timeout_s."""
    body = json.dumps(CHAT).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await _raw(edge)
    started = time.monotonic()
    closed = asyncio.create_task(reader.read())  # b"" once the server closes: no reply at all
    sent = 0
    while not closed.done() and sent < len(head):
        writer.write(head[sent:sent + 1])
        sent += 1
        await asyncio.sleep(0.1)  # one byte every 0.1 s: the head never completes in time
    assert await asyncio.wait_for(closed, 5) == b""
    elapsed = time.monotonic() - started
    assert 0.9 < elapsed < 2.5 and sent < len(head), (elapsed, sent)
    writer.close()
    # An idle connection (nothing sent) is closed the same way.
    reader, writer = await _raw(edge)
    started = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert 0.9 < time.monotonic() - started < 2.5
    writer.close()
    await _still_serves(edge)


async def test_slow_body_is_a_408(edge: ToyStack) -> None:
    """Headers on time, then a body trickling in: 408 at body_timeout_s, and `Connection: close`
    (aiohttp then discards what still comes for at most its lingering time, 10 s, and closes)."""
    body = json.dumps(CHAT).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await _raw(edge)
    writer.write(head)
    started = time.monotonic()

    async def reply() -> tuple[bytes, bytes]:
        headers = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":")[1]) for h in headers.split(b"\r\n") if h.lower().startswith(b"content-length"))
        return headers, await reader.readexactly(length)

    got = asyncio.create_task(reply())
    for i in range(len(body) - 1):  # one byte every 0.1 s: never the last one
        if got.done():
            break
        writer.write(body[i:i + 1])
        await asyncio.sleep(0.1)
    headers, payload = await asyncio.wait_for(got, 5)
    assert 0.9 < time.monotonic() - started < 2.5
    assert headers.startswith(b"HTTP/1.1 408") and b"connection: close" in headers.lower(), headers
    err = json.loads(payload)["error"]
    assert err["code"] == "request_timeout" and "within 1 s" in err["message"], err
    writer.close()
    await _still_serves(edge)


async def test_concurrent_requests_per_client(edge: ToyStack) -> None:
    long = {**CHAT, "max_tokens": 40, "stream": True}  # ~1.2 s each on this engine
    async with _session() as http:
        async def stream() -> str:
            async with http.post(edge.base_url + "/v1/chat/completions", json=long) as r:
                assert r.status == 200
                return await r.text()

        first = [asyncio.create_task(stream()) for _ in range(2)]
        await wait_for(lambda: edge.workers[0].counters["accepted"] == 2)
        for path, body in (("/v1/chat/completions", long), ("/v1/completions", {"model": "toy", "prompt": "hi"})):
            async with http.post(edge.base_url + path, json=body) as r:
                err = (await r.json())["error"]
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1, err
                assert (err["type"], err["code"]) == ("rate_limit_error", "too_many_concurrent_requests")
        async with http.get(edge.base_url + "/v1/models") as r:  # only generations count
            assert r.status == 200
        assert all("[DONE]" in t for t in await asyncio.gather(*first))
    await _still_serves(edge)  # both slots came back
    async with _session() as http, http.get(edge.base_url + "/metrics") as r:
        text = await r.text()
    assert 'status="429"' in text and 'status="5' not in text


async def test_prompt_over_the_context_streamed_completion_is_a_400(nats_server) -> None:
    """(Chat, and non-streamed completions: test_edge_limits.py.) Streamed completions too, before any byte."""
    async with toy_stack(nats_server.url, frontend={"limits": {"max_model_len": 100}}) as stack:
        for prompt in ("x" * 200, [5] * 100):
            status, body = await _post(stack, {"model": "toy", "prompt": prompt, "stream": True}, "/v1/completions")
            assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        await _still_serves(stack)


def test_openapi_states_the_limits() -> None:
    """/openapi.json carries the deployment's bounds (what the fuzz test generates from)."""
    lim = RequestLimits(max_n=3, max_model_len=100, max_logprobs=5, max_stop_sequences=2, max_prompts=7)
    s = openapi_document(limits=lim)["components"]["schemas"]
    chat, comp = s["ChatCompletionRequest"]["properties"], s["CompletionRequest"]["properties"]
    assert chat["n"]["maximum"] == comp["n"]["maximum"] == 3
    assert chat["top_logprobs"]["anyOf"][0]["maximum"] == comp["logprobs"]["anyOf"][0]["maximum"] == 5
    assert comp["max_tokens"]["anyOf"][0]["maximum"] == chat["max_completion_tokens"]["anyOf"][0]["maximum"] == 100
    assert chat["stop"]["anyOf"][1]["maxItems"] == 2 and chat["stop"]["anyOf"][1]["items"]["maxLength"] == 1024
    strings, ids, lists = comp["prompt"]["anyOf"][1:]
    assert (strings["maxItems"], ids["maxItems"], lists["maxItems"], lists["items"]["maxItems"]) == (7, 99, 7, 99)
    assert min(strings["minItems"], ids["minItems"], lists["minItems"], lists["items"]["minItems"]) == 1
    assert "408" in openapi_document()["paths"]["/v1/chat/completions"]["post"]["responses"]
