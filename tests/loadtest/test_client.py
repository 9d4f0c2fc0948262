"""The request client against canned SSE streams: a stream cut off with a bare [DONE] (no
finish_reason; llama-cpp-python's server does this to the running request when the next one
arrives) is an error, not a short success; a server without streamed usage is counted by chunks."""
from __future__ import annotations

import json

import httpx2 as httpx
import openai

from moebus.loadtest.client import RequestRecord, send


def _sse(texts: list[str], finish: str | None, usage: dict | None = None) -> bytes:
    events = []
    for i, t in enumerate(texts):
        last = i == len(texts) - 1
        choice = {"index": 0, "text": t, "logprobs": None, "finish_reason": finish if last else None}
        events.append({"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]})
    if usage is not None:
        events.append({"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [],
                       "usage": usage})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return body.encode()


async def _send(body: bytes, out_tokens: int) -> RequestRecord:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    async with openai.AsyncOpenAI(base_url="http://peer/v1", api_key="x", http_client=http, max_retries=0) as client:
        rec = RequestRecord(0, 0.0, input_tokens=3, output_tokens=out_tokens)
        return await send(client, "m", rec, prompt="a b c", t0=0.0)


async def test_finished_stream_without_usage_counts_chunks() -> None:
    rec = await _send(_sse([" a", " b", " c", " d"], "length"), 4)
    assert rec.ok and rec.finish_reason == "length"
    assert rec.completion_tokens == 4 and rec.prompt_tokens is None
    assert len(rec.itl_s) == 3


async def test_finished_stream_with_usage() -> None:
    rec = await _send(_sse([" a", " b"], "length", {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}), 2)
    assert rec.ok and (rec.prompt_tokens, rec.completion_tokens) == (3, 2)


async def test_stream_cut_short_without_finish_reason_is_an_error() -> None:
    rec = await _send(_sse([" a"], None), 16)
    assert rec.status == 200 and not rec.ok
    assert rec.finish_reason is None and rec.completion_tokens == 1
    assert rec.error is not None and rec.error.startswith("truncated")
