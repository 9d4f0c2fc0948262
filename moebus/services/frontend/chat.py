"""POST /v1/chat/completions (streamed over SSE, or one JSON body)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web

from moebus.shared.errors import ServiceError
from moebus.shared.messages import RenderRequest

from .body import parse_body
from .choice import ChoiceState
from .errors import APIError, bad_request
from .events import Delta, Event, Finish, events
from .formats import SSE, chat_logprobs, usage
from .keys import FRONTEND
from .protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from .service import FrontendService


async def chat_completions(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body = await parse_body(request, ChatCompletionRequest, fe.cfg.limits)
    fe.check_model(body.model)
    try:
        messages = [t.to_message() for t in body.messages]
    except ValueError as e:
        raise bad_request(str(e), param="messages") from None
    rendered = await fe.render(RenderRequest(model=body.model, messages=messages))
    params = body.to_sampling()
    prompt = rendered.prompt_token_ids
    fe.check_context(len(prompt), params.max_tokens, "messages")
    started = time.monotonic()
    async with fe.generation(body.model, prompt, params, restartable=not body.stream) as gen:
        choices = fe.choices(0, params, prompt, body.model)
        base = {"id": "chatcmpl-" + gen.request_id[4:], "created": int(time.time()), "model": body.model}
        stream = events([(gen, choices)])
        if not body.stream:
            async for _ in _with_errors(stream):
                pass
            fe.m_tokens.inc(sum(c.num_tokens for c in choices))
            return web.json_response({
                **base, "object": "chat.completion", "system_fingerprint": None,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "logprobs": chat_logprobs(c.logprobs) if params.logprobs is not None else None,
                             "finish_reason": c.finish_reason} for c in choices],
                "usage": usage(len(prompt), choices, choices[0].num_cached_tokens),
            })
        return await _stream(request, fe, body, base, stream, choices, params.logprobs is not None,
                             len(prompt), started)


async def _with_errors(stream: AsyncIterator[Event]) -> AsyncIterator[Event]:
    try:
        async for ev in stream:
            yield ev
    except ServiceError as e:
        raise APIError.from_service_error(e) from None


async def _stream(request: web.Request, fe: FrontendService, body: ChatCompletionRequest, base: dict,
                  stream: AsyncIterator[Event], choices: list[ChoiceState], want_logprobs: bool, n_prompt: int,
                  started: float) -> web.StreamResponse:
    sse = SSE(request)
    base = {**base, "object": "chat.completion.chunk", "system_fingerprint": None}
    extra = {"usage": None} if body.include_usage else {}

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        return {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish}], **extra}

    try:  # errors before the first token keep their HTTP status
        first = await anext(stream, None)
    except ServiceError as e:
        raise APIError.from_service_error(e) from None
    fe.m_ttft.observe(time.monotonic() - started)
    await sse.open()
    for c in choices:
        await sse.send(chunk(c.index, {"role": "assistant", "content": ""}))
    try:
        ev = first
        while ev is not None:
            if isinstance(ev, Delta) and (ev.text or ev.logprobs):
                lp = chat_logprobs(ev.logprobs) if want_logprobs else None
                await sse.send(chunk(ev.choice.index, {"content": ev.text}, logprobs=lp))
            elif isinstance(ev, Finish):
                await sse.send(chunk(ev.choice.index, {}, ev.choice.finish_reason))
            ev = await anext(stream, None)
    except ServiceError as e:  # headers are gone: report in-band, as OpenAI does
        await sse.send(APIError.from_service_error(e).body())
        return await sse.close()
    fe.m_tokens.inc(sum(c.num_tokens for c in choices))
    if body.include_usage:
        await sse.send({**base, "choices": [], "usage": usage(n_prompt, choices, choices[0].num_cached_tokens)})
    return await sse.close()
