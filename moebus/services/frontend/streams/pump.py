"""The one SSE loop of every streaming endpoint; each endpoint passes in a writer: its framing and
the payloads of each stage.

Order on the wire: the HTTP status is decided at the first step (an error before it keeps its
status: 400, 429, 503, ...); then the writer's preamble (chat: the assistant role; completions: the
echoed prompt; Responses: response.created / in_progress; Messages: message_start) goes out with the
first step's payloads, each later step's payloads, the closing payloads (chat and completions: the
usage chunk when asked for; Responses: the open item's done events and response.completed;
Messages: message_delta, message_stop) and the framing's end (`data: [DONE]` for plain SSE). An
error after the headers went out is sent in-band, in the writer's shape, as OpenAI and Anthropic do.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol, TypeVar

from aiohttp import web

from moebus.shared.errors import ServiceError

from ..errors import APIError
from ..keys import FRONTEND, RECORD
from .sse import SSE

S = TypeVar("S", contravariant=True)


class StreamWriter(Protocol[S]):
    """The per-endpoint part of a stream; steps of type S (chat and completions: events; Responses
    and Messages: a turn's outs)."""

    framing: type[SSE]  # SSE (`data:` lines, `[DONE]`) or NamedSSE (`event:` + `data:`)

    def preamble(self) -> list[dict]:
        """Payloads sent right after the headers, once the first step came (or the stream ended)."""
        ...

    def step(self, step: S) -> list[dict]:
        """A step's payloads (none while text is held back, e.g. a tool call's tag arriving)."""
        ...

    def error(self, err: APIError) -> dict:
        """The in-band error, after the headers went out; the stream ends after it."""
        ...

    def closing(self) -> list[dict]:
        """Payloads after the last step."""
        ...


async def pump(request: web.Request, steps: AsyncIterator[S], writer: StreamWriter[S], *,
               started: float | None = None) -> web.StreamResponse:
    """Stream `steps` through `writer`: one write per step (the first with the preamble: the headers
    go with them, so the first token costs the client one segment; NamedSSE writes each event).
    started (chat and completions): when the generation was asked for; the time to the first step
    goes to m_ttft."""
    try:  # errors before the first step keep their HTTP status
        first = await anext(steps, None)
    except ServiceError as e:
        raise APIError.from_service_error(e) from None
    if started is not None:
        request.app[FRONTEND].m_ttft.observe(time.monotonic() - started)
    sse = writer.framing(request)
    await sse.open()
    payloads = writer.preamble()
    try:
        step = first
        while step is not None:
            await sse.send_all(payloads + writer.step(step))
            payloads = []
            step = await anext(steps, None)
        await sse.send_all(payloads)  # the stream ended before any step: the preamble alone
    except (ServiceError, APIError) as e:  # headers are gone: report in-band
        err = APIError.from_service_error(e) if isinstance(e, ServiceError) else e
        if (rec := request.get(RECORD)) is not None:
            rec.error = f"in-band {err.status} {err.code}: {err.message}"[:500]
        await sse.send(writer.error(err))
        return await sse.close()
    await sse.send_all(writer.closing())
    return await sse.close()
