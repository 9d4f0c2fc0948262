"""The one SSE loop of the streaming endpoints; each endpoint passes in how its chunks look.

Order on the wire: the HTTP status is decided at the first event (an error before it keeps its
status: 400, 429, 503, ...); then the endpoint's preamble (chat: the assistant role; completions:
the echoed prompt), a chunk per delta with text or logprobs, a chunk per finished choice, the
usage chunk when asked for, and ``data: [DONE]``. An error after the headers went out is sent
in-band as an error event, as OpenAI does.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from moebus.shared.errors import ServiceError

from ..choices.choice import ChoiceState
from ..errors import APIError
from ..keys import RECORD
from .events import Delta, Event, Finish
from .formats import SSE, usage

if TYPE_CHECKING:
    from ..service import FrontendService


class ChunkFormat(Protocol):
    """The per-endpoint part: the `choices[0]` entry of each chunk."""

    def preamble(self) -> list[dict]:
        """Entries sent right after the headers, before any generated text."""
        ...

    def delta(self, ev: Delta) -> list[dict]:
        """Entries for a delta (none while text is held back, e.g. a tool call's tag arriving)."""
        ...

    def finish(self, choice: ChoiceState) -> list[dict]: ...


async def pump_sse(request: web.Request, fe: FrontendService, stream: AsyncIterator[Event], fmt: ChunkFormat, *,
                   base: dict, groups: Sequence[list[ChoiceState]], n_prompt: int, include_usage: bool,
                   started: float, continuous_usage: bool = False) -> web.StreamResponse:
    """Stream `stream` as chunks `{**base, "choices": [entry]}`; `groups`: the choices of each prompt.
    continuous_usage (vLLM's stream_options.continuous_usage_stats): every chunk carries the usage so far."""
    try:  # errors before the first token keep their HTTP status
        first = await anext(stream, None)
    except ServiceError as e:
        raise APIError.from_service_error(e) from None
    fe.m_ttft.observe(time.monotonic() - started)
    sse = SSE(request)
    await sse.open()
    extra = {"usage": None} if include_usage else {}
    choices = [c for cs in groups for c in cs]

    async def send(entries: list[dict]) -> None:
        """One event's entries in one write (the first event's with the preamble: the headers go
        with them, so the first token costs the client one segment)."""
        if continuous_usage:
            extra["usage"] = usage(n_prompt, choices, sum(cs[0].num_cached_tokens for cs in groups))
        await sse.send_all([{**base, "choices": [entry], **extra} for entry in entries])

    entries = list(fmt.preamble())
    try:
        ev = first
        while ev is not None:
            if isinstance(ev, Delta) and (ev.text or ev.logprobs):
                entries += fmt.delta(ev)
            elif isinstance(ev, Finish):
                entries += fmt.finish(ev.choice)
            await send(entries)
            entries = []
            ev = await anext(stream, None)
        if entries:  # the stream ended before any event: the preamble alone
            await send(entries)
    except ServiceError as e:  # headers are gone: report in-band, as OpenAI does
        err = APIError.from_service_error(e)
        if (rec := request.get(RECORD)) is not None:
            rec.error = f"in-band {err.status} {err.code}: {err.message}"[:500]
        await sse.send(err.body())
        return await sse.close()
    fe.m_tokens.inc(sum(c.num_tokens for c in choices))
    if include_usage:
        cached = sum(cs[0].num_cached_tokens for cs in groups)
        await sse.send({**base, "choices": [], "usage": usage(n_prompt, choices, cached)})
    return await sse.close()
