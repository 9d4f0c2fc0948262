"""The pump byte for byte, for chat and completions chunks, from scripted event streams: role /
echo preamble, deltas with logprobs, finish, usage, an in-band error after the headers, and an
error before the first event that keeps its HTTP status."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from moebus.services.frontend.api.chat import _ChatChunks
from moebus.services.frontend.api.completions import _CompletionChunks
from moebus.services.frontend.choices.choice import ChoiceState
from moebus.services.frontend.errors import APIError
from moebus.services.frontend.keys import FRONTEND
from moebus.services.frontend.streams.chunks import ChunkWriter
from moebus.services.frontend.streams.events import Delta, Event, Finish
from moebus.services.frontend.streams.pump import pump
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import TokenLogprob, TopLogprob

CHAT_BASE = {"id": "chatcmpl-1", "created": 1, "model": "toy", "object": "chat.completion.chunk",
             "system_fingerprint": None}
CMPL_BASE = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "toy", "system_fingerprint": None}


class _Counter:
    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, v: float = 1) -> None:
        self.value += v

    def observe(self, v: float) -> None:
        self.value += 1


class _FE:
    def __init__(self) -> None:
        self.m_ttft, self.m_tokens = _Counter(), _Counter()


def script(groups: list[list[ChoiceState]], fail: str | None = None) -> Callable[[], AsyncIterator[Event]]:
    """Two deltas and a finish per choice (the second delta with logprobs); `fail`: "first" / "later"."""
    async def gen() -> AsyncIterator[Event]:
        if fail == "first":
            raise ServiceError(ErrorCode.OVERLOADED, "busy")
        for cs in groups:
            for c in cs:
                c.num_tokens, c.num_cached_tokens, c.finish_reason = 3, 2, "length"
                yield Delta(c, "Hé", [])
                if fail == "later":
                    raise ServiceError(ErrorCode.WORKER_LOST, "gone")
                lp = TokenLogprob(token_id=5, token="llo", logprob=-0.5, top=[TopLogprob(token_id=5, token="llo",
                                                                                          logprob=-0.5)])
                yield Delta(c, "llo", [lp])
                yield Delta(c, "", [])  # nothing to send
                yield Finish(c)
    return gen


async def serve(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> tuple[int, bytes]:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()

    app = web.Application()
    app[FRONTEND] = _FE()  # type: ignore[assignment]
    app.router.add_post("/", wrapped)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/")
        return resp.status, await resp.read()


def chat_handler(n: int, include_usage: bool, fail: str | None = None) -> Callable[..., Any]:
    async def handler(request: web.Request) -> web.StreamResponse:
        choices = [ChoiceState(i, None) for i in range(n)]  # type: ignore[arg-type]
        writer = ChunkWriter(_FE(), _ChatChunks(choices, True), base=CHAT_BASE, groups=[choices],  # type: ignore[arg-type]
                             n_prompt=4, include_usage=include_usage)
        return await pump(request, script([choices], fail)(), writer, started=0.0)
    return handler


def completion_handler(echoes: list[str] | None, n: int, include_usage: bool) -> Callable[..., Any]:
    async def handler(request: web.Request) -> web.StreamResponse:
        groups = [[ChoiceState(k * n + i, None) for i in range(n)] for k in range(2)]  # type: ignore[arg-type]
        fmt = _CompletionChunks([c for cs in groups for c in cs], echoes, n, True)
        writer = ChunkWriter(_FE(), fmt, base=CMPL_BASE, groups=groups, n_prompt=6,  # type: ignore[arg-type]
                             include_usage=include_usage)
        return await pump(request, script(groups)(), writer, started=0.0)
    return handler


def events_of(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    return [e.removeprefix(b"data: ") for e in raw[:-2].split(b"\n\n")]


_LP = (b'{"content":[{"token":"llo","logprob":-0.5,"bytes":[108,108,111],"top_logprobs":[{"token":"llo",'
       b'"logprob":-0.5,"bytes":[108,108,111]}]}]}')
_CHAT = b'{"id":"chatcmpl-1","created":1,"model":"toy","object":"chat.completion.chunk","system_fingerprint":null,'


async def test_chat_stream_bytes() -> None:
    status, raw = await serve(chat_handler(1, include_usage=True))
    assert status == 200
    assert events_of(raw) == [
        _CHAT + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null}],"usage":null}',
        _CHAT + b'"choices":[{"index":0,"delta":{"content":"H\xc3\xa9"},"logprobs":{"content":[]},'
                b'"finish_reason":null}],"usage":null}',
        _CHAT + b'"choices":[{"index":0,"delta":{"content":"llo"},"logprobs":' + _LP
              + b',"finish_reason":null}],"usage":null}',
        _CHAT + b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":null}',
        _CHAT + b'"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7,'
                b'"prompt_tokens_details":{"cached_tokens":2}}}',
        b"[DONE]",
    ]


async def test_chat_stream_without_usage_has_no_usage_key() -> None:
    _, raw = await serve(chat_handler(2, include_usage=False))
    evs = events_of(raw)
    assert len(evs) == 2 + 2 * 3 + 1 and b"usage" not in raw
    assert [e.count(b'"role":"assistant"') for e in evs[:3]] == [1, 1, 0]  # one role chunk per choice, first


async def test_errors_before_and_after_the_first_event() -> None:
    status, raw = await serve(chat_handler(1, include_usage=True, fail="first"))
    assert status == 429 and b'"code": "overloaded"' in raw and b"[DONE]" not in raw
    status, raw = await serve(chat_handler(1, include_usage=True, fail="later"))
    assert status == 200
    assert events_of(raw)[-2:] == [b'{"error":{"message":"gone","type":"service_unavailable","param":null,'
                                   b'"code":"worker_lost"}}', b"[DONE]"]


_CMPL = b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"toy","system_fingerprint":null,'


async def test_completion_stream_bytes_with_echo() -> None:
    status, raw = await serve(completion_handler(["ab", "xyz"], 1, include_usage=True))
    assert status == 200
    lp = (b'{"tokens":["llo"],"token_logprobs":[-0.5],"top_logprobs":[{"llo":-0.5}],"text_offset":[%d]}')
    first = [
        _CMPL + b'"choices":[{"index":0,"text":"ab","logprobs":null,"finish_reason":null}],"usage":null}',
        _CMPL + b'"choices":[{"index":1,"text":"xyz","logprobs":null,"finish_reason":null}],"usage":null}',
        _CMPL + b'"choices":[{"index":0,"text":"H\xc3\xa9","logprobs":{"tokens":[],"token_logprobs":[],'
                b'"top_logprobs":[],"text_offset":[]},"finish_reason":null}],"usage":null}',
        _CMPL + b'"choices":[{"index":0,"text":"llo","logprobs":' + lp % 4 + b',"finish_reason":null}],"usage":null}',
        _CMPL + b'"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":null}',
    ]
    evs = events_of(raw)
    assert evs[:5] == first
    assert evs[6] == _CMPL + b'"choices":[{"index":1,"text":"llo","logprobs":' + lp % 5 + b',"finish_reason":null}],' \
                             b'"usage":null}'  # text offsets count the echo
    assert evs[-2:] == [_CMPL + b'"choices":[],"usage":{"prompt_tokens":6,"completion_tokens":6,"total_tokens":12,'
                                b'"prompt_tokens_details":{"cached_tokens":4}}}', b"[DONE]"]


@pytest.mark.parametrize("n", [1, 2])
async def test_completion_stream_without_echo(n: int) -> None:
    _, raw = await serve(completion_handler(None, n, include_usage=False))
    evs = events_of(raw)
    assert len(evs) == 2 * n * 3 + 1 and b"usage" not in raw
    assert evs[0].startswith(_CMPL + b'"choices":[{"index":0,"text":"H\xc3\xa9"')


async def test_first_token_goes_out_with_the_preamble(monkeypatch: pytest.MonkeyPatch) -> None:
    """The role chunk and the first delta leave in one write (with the headers), so the client's
    first token does not wait on a second segment; each later event is one write."""
    writes: list[bytes] = []
    real = web.StreamResponse.write

    async def write(self: web.StreamResponse, data: bytes) -> None:
        writes.append(bytes(data))
        await real(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    _, raw = await serve(chat_handler(1, include_usage=True))
    assert b"".join(writes) == raw
    assert [w.count(b"data: ") for w in writes] == [2, 1, 1, 1, 1]  # role + "Hé", "llo", finish, usage, [DONE]
    assert b'"role":"assistant"' in writes[0] and b'"content":"H\xc3\xa9"' in writes[0]
