"""Every streaming endpoint's wire, byte for byte, on the toy stack: the raw HTTP response (status,
headers, chunked framing: one HTTP chunk per write) of Responses, Messages, chat and completions
streams, text and tool calls, cut by max tokens, a stop sequence, an error before the first token
(its status) and an in-band error after it, against the files in wire/ (ids and times masked)."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from moebus.devmodel.toy import TOY_REPLY, ToyEngine, ToyEngineConfig

from ..conftest import toy_stack
from .test_tools_api import CALLS

WIRE = Path(__file__).parent / "wire"
FAIL_AT = 77  # max tokens that make the engine fail the request at its 6th token (after 5 went out)
MSG = [{"role": "user", "content": "hi"}]
R_TOOLS = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in ("get_weather", "get_time")]
A_TOOLS = [{"name": n, "input_schema": {"type": "object"}} for n in ("get_weather", "get_time")]
C_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
           for n in ("get_weather", "get_time")]

TEXT = {
    "responses_length": ("/v1/responses", {"model": "toy", "input": "hi", "stream": True, "max_output_tokens": 5}),
    "responses_in_band_error": ("/v1/responses", {"model": "toy", "input": "hi", "stream": True,
                                                  "max_output_tokens": FAIL_AT}),
    "responses_too_long": ("/v1/responses", {"model": "toy", "input": "x" * 5000, "stream": True}),
    "messages_stop_sequence": ("/v1/messages", {"model": "toy", "messages": MSG, "stream": True, "max_tokens": 200,
                                                "stop_sequences": ["toy"]}),
    "messages_length": ("/v1/messages", {"model": "toy", "messages": MSG, "stream": True, "max_tokens": 5}),
    "messages_in_band_error": ("/v1/messages", {"model": "toy", "messages": MSG, "stream": True,
                                                "max_tokens": FAIL_AT}),
    "messages_too_long": ("/v1/messages", {"model": "toy", "messages": [{"role": "user", "content": "x" * 5000}],
                                           "stream": True, "max_tokens": 10}),
    "chat_in_band_error": ("/v1/chat/completions", {"model": "toy", "messages": MSG, "stream": True,
                                                    "max_tokens": FAIL_AT}),
    "completions_logprobs_usage": ("/v1/completions", {
        "model": "toy", "prompt": "ab", "stream": True, "max_tokens": 20, "logprobs": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    "completions_in_band_error": ("/v1/completions", {"model": "toy", "prompt": "ab", "stream": True,
                                                      "max_tokens": FAIL_AT}),
}
TOOLS = {
    "responses_calls": ("/v1/responses", {"model": "toy", "input": "w?", "stream": True, "tools": R_TOOLS,
                                          "max_output_tokens": 300}),
    "messages_calls": ("/v1/messages", {"model": "toy", "messages": MSG, "stream": True, "tools": A_TOOLS,
                                        "max_tokens": 300}),
    "chat_calls": ("/v1/chat/completions", {"model": "toy", "messages": MSG, "stream": True, "tools": C_TOOLS,
                                            "max_tokens": 300}),
}


class _Failing(ToyEngine):
    """The toy model, failing a request asked for FAIL_AT tokens at its 6th."""

    def step(self):  # type: ignore[no-untyped-def]
        outs = super().step()
        for o in outs:
            if any(r.group == o.request_id and r.params.max_tokens == FAIL_AT and len(r.out) == 6
                   for r in self._running.values()):
                o.error, o.new_token_ids = "boom", []
        return outs


async def raw(base_url: str, path: str, body: dict) -> bytes:
    """The response as it came over the socket (HTTP/1.1, the connection closed after it)."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    headers = {"Host": f"{host}:{port}", "Content-Type": "application/json", "Content-Length": str(len(data)),
               "Connection": "close", "Authorization": "Bearer none"}
    writer.write(f"POST {path} HTTP/1.1\r\n".encode() + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
                 + b"\r\n" + data)
    await writer.drain()
    out = await reader.read()
    writer.close()
    return out


def masked(response: bytes) -> str:
    """Ids, times and the per-request headers masked, lengths kept (the chunk sizes stay true)."""
    head, _, body = response.partition(b"\r\n\r\n")
    lines = [h for h in head.split(b"\r\n")
             if not h.lower().startswith((b"date:", b"x-request-id:", b"server:", b"x-trace-id:"))]
    body = re.sub(rb"[0-9a-f]{12,}", lambda m: b"x" * len(m.group()), body)
    body = re.sub(rb'("created(?:_at)?":)\d+', lambda m: m.group(1) + b"9" * (len(m.group()) - len(m.group(1))), body)
    return (b"\r\n".join(lines) + b"\r\n\r\n" + body).decode("utf-8", "backslashreplace")


@pytest.mark.parametrize(("reply", "cases"), [(TOY_REPLY, TEXT), (CALLS, TOOLS)], ids=["text", "tool_calls"])
async def test_stream_wire_bytes(nats_server, reply: str, cases: dict) -> None:
    factory = lambda: _Failing(ToyEngineConfig(step_delay_s=0.002, reply=reply))  # noqa: E731
    async with toy_stack(nats_server.url, engine_factory=factory) as stack:
        for name, (path, body) in cases.items():
            got = masked(await raw(stack.base_url, path, body))
            assert got == (WIRE / f"{name}.http").read_bytes().decode(), name
