"""POST /v1/completions: one or several prompts (text or token ids), n choices each."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

from aiohttp import web

from moebus.shared.errors import ServiceError
from moebus.shared.messages import RenderRequest

from .body import parse_body
from .choice import ChoiceState
from .errors import APIError, bad_request
from .events import Delta, Event, Finish, Restart, events
from .formats import SSE, completion_logprobs, usage
from .generation import Generation
from .keys import FRONTEND
from .protocol import CompletionRequest

if TYPE_CHECKING:
    from .service import FrontendService


async def completions(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body = await parse_body(request, CompletionRequest, fe.cfg.limits)
    fe.check_model(body.model)
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    params = body.to_sampling()
    prompts: list[tuple[list[int], str]] = []
    for p in body.prompts():
        if isinstance(p, str):
            r = await fe.render(RenderRequest(model=body.model, prompt=p))
            prompts.append((r.prompt_token_ids, p))
        elif body.echo:
            raise bad_request("echo needs text prompts", param="echo")
        else:  # the tokenizer checks the ids against the vocabulary
            fe.check_context(len(p), params.max_tokens, "prompt")
            r = await fe.render(RenderRequest(model=body.model, prompt_token_ids=p))
            prompts.append((r.prompt_token_ids, ""))
        fe.check_context(len(prompts[-1][0]), params.max_tokens, "prompt")
    started = time.monotonic()
    async with AsyncExitStack() as stack:
        pairs = []
        for k, (ids, _) in enumerate(prompts):
            gen = await stack.enter_async_context(fe.generation(body.model, ids, params, restartable=not body.stream))
            pairs.append((gen, fe.choices(k * params.n, params, ids, body.model)))
        base = {"id": "cmpl-" + pairs[0][0].request_id[4:], "object": "text_completion", "created": int(time.time()),
                "model": body.model, "system_fingerprint": None}
        n_prompt = sum(len(ids) for ids, _ in prompts)
        stream = events(pairs)
        want_lp = params.logprobs is not None
        if not body.stream:
            try:
                async for ev in stream:
                    if isinstance(ev, Restart):
                        continue
            except ServiceError as e:
                raise APIError.from_service_error(e) from None
            all_choices = [c for _, cs in pairs for c in cs]
            fe.m_tokens.inc(sum(c.num_tokens for c in all_choices))
            out = []
            for c in all_choices:
                echo = prompts[c.index // params.n][1] if body.echo else ""
                out.append({"index": c.index, "text": echo + c.text, "finish_reason": c.finish_reason,
                            "logprobs": completion_logprobs(c.logprobs, len(echo)) if want_lp else None})
            cached = sum(cs[0].num_cached_tokens for _, cs in pairs)
            return web.json_response({**base, "choices": out, "usage": usage(n_prompt, all_choices, cached)})
        return await _stream(request, fe, body, base, stream, pairs, prompts, want_lp, n_prompt, started)


async def _stream(request: web.Request, fe: FrontendService, body: CompletionRequest, base: dict,
                  stream: AsyncIterator[Event], pairs: list[tuple[Generation, list[ChoiceState]]],
                  prompts: list[tuple[list[int], str]], want_lp: bool, n_prompt: int,
                  started: float) -> web.StreamResponse:
    extra = {"usage": None} if body.include_usage else {}
    offsets: dict[int, int] = {}

    def chunk(index: int, text: str, finish: str | None = None, lp: dict | None = None) -> dict:
        return {**base, "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}], **extra}

    try:
        first = await anext(stream, None)
    except ServiceError as e:
        raise APIError.from_service_error(e) from None
    fe.m_ttft.observe(time.monotonic() - started)
    sse = SSE(request)
    await sse.open()
    if body.echo:
        for _, cs in pairs:
            for c in cs:
                echo = prompts[c.index // body.n][1]
                offsets[c.index] = len(echo)
                await sse.send(chunk(c.index, echo))
    try:
        ev = first
        while ev is not None:
            if isinstance(ev, Delta) and (ev.text or ev.logprobs):
                i = ev.choice.index
                lp = completion_logprobs(ev.logprobs, offsets.get(i, 0)) if want_lp else None
                offsets[i] = offsets.get(i, 0) + len(ev.text)
                await sse.send(chunk(i, ev.text, lp=lp))
            elif isinstance(ev, Finish):
                await sse.send(chunk(ev.choice.index, "", ev.choice.finish_reason))
            ev = await anext(stream, None)
    except ServiceError as e:
        await sse.send(APIError.from_service_error(e).body())
        return await sse.close()
    all_choices = [c for _, cs in pairs for c in cs]
    fe.m_tokens.inc(sum(c.num_tokens for c in all_choices))
    if body.include_usage:
        cached = sum(cs[0].num_cached_tokens for _, cs in pairs)
        await sse.send({**base, "choices": [], "usage": usage(n_prompt, all_choices, cached)})
    return await sse.close()
