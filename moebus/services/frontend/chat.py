"""POST /v1/chat/completions (streamed over SSE, or one JSON body)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from moebus.shared.errors import ServiceError
from moebus.shared.messages import RenderRequest

from .body import parse_body
from .choice import ChoiceState
from .errors import APIError, bad_request
from .events import Delta, Event, events
from .formats import chat_logprobs, usage
from .images import place
from .keys import FRONTEND, TENANT
from .protocol import ChatCompletionRequest
from .sse_pump import pump_sse


async def chat_completions(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body = await parse_body(request, ChatCompletionRequest, fe.cfg.limits)
    fe.check_model(body.model)
    urls: list[str] = []
    try:
        messages = [t.to_message(urls) for t in body.messages]
    except ValueError as e:
        raise bad_request(str(e), param="messages") from None
    render = RenderRequest(model=body.model, messages=messages, add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           chat_template_kwargs=body.template_kwargs())
    encoded = None
    if urls:  # images first: the tokenizer needs each one's token count
        encoded = await fe.encode_images(body.model, urls)
        render.images, render.image_form = [im.num_tokens for im in encoded.images], encoded.form
    rendered = await fe.render(render)
    params = body.to_sampling()
    prompt = rendered.prompt_token_ids
    fe.check_context(len(prompt), params.max_tokens, "messages")
    images = place(encoded.images, rendered.image_offsets) if encoded else []
    started = time.monotonic()
    async with fe.generation(body.model, prompt, params, images, request.get(TENANT)) as gen:
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
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices],
                "usage": usage(len(prompt), choices, choices[0].num_cached_tokens),
            })
        base = {**base, "object": "chat.completion.chunk", "system_fingerprint": None}
        return await pump_sse(request, fe, stream, _ChatChunks(choices, params.logprobs is not None), base=base,
                              groups=[choices], n_prompt=len(prompt), include_usage=body.include_usage,
                              started=started)


async def _with_errors(stream: AsyncIterator[Event]) -> AsyncIterator[Event]:
    try:
        async for ev in stream:
            yield ev
    except ServiceError as e:
        raise APIError.from_service_error(e) from None


@dataclass(slots=True)
class _ChatChunks:
    """chat.completion.chunk entries: the assistant role first, then content deltas."""

    choices: list[ChoiceState]
    want_logprobs: bool

    def preamble(self) -> list[dict]:
        return [self._entry(c.index, {"role": "assistant", "content": ""}) for c in self.choices]

    def delta(self, ev: Delta) -> dict:
        lp = chat_logprobs(ev.logprobs) if self.want_logprobs else None
        return self._entry(ev.choice.index, {"content": ev.text}, logprobs=lp)

    def finish(self, choice: ChoiceState) -> dict:
        return {**self._entry(choice.index, {}, choice.finish_reason), "stop_reason": choice.stop_reason}

    @staticmethod
    def _entry(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
