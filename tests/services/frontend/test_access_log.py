"""The operator's view of each request (#19 item 6, #18 item 5): X-Request-Id on every response,
one access line per request (status, tokens, TTFT, total time, ids, the reason of a 4xx/5xx),
client disconnects as 499, and JSON log lines that carry the request and trace ids."""
from __future__ import annotations

import asyncio
import io
import json
import logging

import aiohttp
import pytest
from opentelemetry.sdk.trace import TracerProvider

from moebus.shared.logs import JsonFormatter, RequestContext, TextFormatter, request_scope

from ..conftest import ToyStack, toy_stack, wait_for

CHAT = [{"role": "user", "content": "hi"}]


def _access(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "moebus.access"]


async def test_request_id_echoed_or_made_on_every_response(stack: ToyStack, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="moebus.access")
    async with aiohttp.ClientSession(stack.base_url) as http:
        body = {"model": "toy", "messages": CHAT, "max_tokens": 3}
        async with http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "mine-1"}) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "mine-1"
            usage = (await r.json())["usage"]
        async with http.post("/v1/chat/completions", json={**body, "stream": True}) as r:  # a stream: made up
            made = r.headers["X-Request-Id"]
            assert r.status == 200 and len(made) == 32 and "[DONE]" in await r.text()
        async with http.post("/v1/chat/completions", json={**body, "model": "nope"},
                             headers={"X-Request-Id": "mine-2"}) as r:  # an error keeps it too
            assert r.status == 404 and r.headers["X-Request-Id"] == "mine-2"
        async with http.get("/nowhere", headers={"X-Request-Id": "x" * 500}) as r:  # unusable: replaced
            assert r.status == 404 and len(r.headers["X-Request-Id"]) == 32
        async with http.get("/health", headers={"X-Request-Id": "probe"}) as r:
            assert r.headers["X-Request-Id"] == "probe"
    lines = {r.request_id: r for r in _access(caplog)}
    ok = lines["mine-1"]
    assert (ok.status, ok.path, ok.model, ok.prompt_tokens, ok.completion_tokens) == (
        200, "/v1/chat/completions", "toy", usage["prompt_tokens"], 3)
    assert 0 < ok.ttft_s <= ok.total_s and ok.error is None
    assert ok.generations.startswith("gen-")  # the id the worker knew it by
    assert lines[made].status == 200 and lines[made].completion_tokens == 3
    bad = lines["mine-2"]
    assert bad.status == 404 and bad.error.startswith("model_not_found: The model 'nope'")
    assert lines["probe"].levelno == logging.DEBUG and lines["mine-1"].levelno == logging.INFO
    assert len(_access(caplog)) == 5  # one line per request


async def test_a_client_gone_mid_stream_is_a_499(stack: ToyStack, caplog) -> None:
    caplog.set_level(logging.INFO, logger="moebus.access")
    body = {"model": "toy", "messages": CHAT, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession(stack.base_url) as http:
        resp = await http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "leaver"})
        await resp.content.readline()  # the first chunk is out: the stream runs
        resp.close()  # the client goes away
    await wait_for(lambda: any(r.request_id == "leaver" for r in _access(caplog)), timeout=10)
    line = next(r for r in _access(caplog) if r.request_id == "leaver")
    assert line.status == 499 and line.levelno == logging.INFO
    async with aiohttp.ClientSession(stack.base_url) as http, http.get("/metrics") as r:
        text = await r.text()
    assert 'http_requests_total{route="/v1/chat/completions",status="499"} 1.0' in text
    assert 'status="500"' not in text
    await stack.wait_idle()  # the worker was told to stop


async def test_json_lines_carry_request_and_trace_ids(nats_server) -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestContext("frontend"))
    root = logging.getLogger()
    root.addHandler(handler)
    old = root.level
    root.setLevel(logging.INFO)
    try:
        async with toy_stack(nats_server.url, tracer_provider=TracerProvider()) as stack:
            traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            r = await stack.client().chat.completions.with_raw_response.create(
                model="toy", messages=CHAT, max_tokens=2, extra_body={"frobnicate": 1},
                extra_headers={"X-Request-Id": "json-1", "traceparent": traceparent})
            assert r.headers["x-request-id"] == "json-1"
            await wait_for(lambda: any('"moebus.access"' in x and '"json-1"' in x  # written after the response
                                       for x in out.getvalue().splitlines()))
    finally:
        root.removeHandler(handler)
        root.setLevel(old)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    mine = [x for x in lines if x["request_id"] == "json-1"]
    # the unknown-field warning (schema/protocol.py) and the access line: both about this request
    assert {x["logger"] for x in mine} >= {"moebus.services.frontend.schema.protocol", "moebus.access"}
    assert all(x["trace_id"] == "0af7651916cd43dd8448eb211c80319c" for x in mine)
    access = next(x for x in mine if x["logger"] == "moebus.access")
    assert access["status"] == 200 and access["completion_tokens"] == 2 and access["service"] == "frontend"


def test_text_lines_name_the_request() -> None:
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("there",), None)
    with request_scope("r-7"):
        RequestContext("worker").filter(rec)
    line = TextFormatter("worker").format(rec)
    assert line.endswith("worker INFO x: hello there request_id=r-7")


async def test_workers_log_a_stats_line_while_busy(nats_server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="moebus.services.worker.stats_log")
    async with toy_stack(nats_server.url, worker={"stats_log_interval_s": 0.2}) as stack:
        await asyncio.sleep(0.5)  # two of its intervals: an idle worker logs nothing
        assert not [r for r in caplog.records if r.name.endswith("stats_log")]
        await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=40)
        await wait_for(lambda: any("generation" in r.getMessage() for r in caplog.records), timeout=5)
    line = next(r.getMessage() for r in caplog.records if r.name.endswith("stats_log"))
    assert line.startswith("stats: running ") and "KV cache" in line
    rate = float(line.split("generation ")[1].split(" tok/s")[0])
    assert rate > 0
