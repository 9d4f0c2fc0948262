"""POST /v1/completions: one or several prompts (text or token ids), n choices each."""
from __future__ import annotations

import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from aiohttp import web

from moebus.shared.errors import ServiceError
from moebus.shared.messages import RenderRequest

from ..choices.choice import ChoiceState
from ..errors import APIError, bad_request
from ..keys import FRONTEND, TENANT
from ..schema.body import parse_body
from ..schema.protocol import CompletionRequest
from ..streams.chunks import ChunkWriter
from ..streams.events import Delta, events
from ..streams.formats import completion_logprobs, usage
from ..streams.pump import pump


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
        else:  # the tokenizer checks the ids against the vocabulary
            fe.check_context(len(p), params.max_tokens, "prompt")
            r = await fe.render(RenderRequest(model=body.model, prompt_token_ids=p))
            echo = await fe.detokenize_all(body.model, r.prompt_token_ids) if body.echo else ""
            prompts.append((r.prompt_token_ids, echo))
        fe.check_context(len(prompts[-1][0]), params.max_tokens, "prompt")
    started = time.monotonic()
    owner = f"call-{uuid.uuid4().hex}" if len(prompts) > 1 else ""  # the prompts share one fair share
    async with AsyncExitStack() as stack:
        pairs = []
        for k, (ids, _) in enumerate(prompts):
            gen = await stack.enter_async_context(fe.generation(body.model, ids, params, tenant=request.get(TENANT),
                                                                owner=owner))
            pairs.append((gen, fe.choices(k * params.n, params, ids, body.model)))
        base = {"id": "cmpl-" + pairs[0][0].request_id[4:], "object": "text_completion", "created": int(time.time()),
                "model": body.model, "system_fingerprint": None}
        n_prompt = sum(len(ids) for ids, _ in prompts)
        stream = events(pairs)
        want_lp = params.logprobs is not None
        if not body.stream:
            try:
                async for _ in stream:  # the choices collect their text and logprobs
                    pass
            except ServiceError as e:
                raise APIError.from_service_error(e) from None
            all_choices = [c for _, cs in pairs for c in cs]
            fe.m_tokens.inc(sum(c.num_tokens for c in all_choices))
            out = []
            for c in all_choices:
                echo = prompts[c.index // params.n][1] if body.echo else ""
                out.append({"index": c.index, "text": echo + c.text, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                            "logprobs": completion_logprobs(c.logprobs, len(echo)) if want_lp else None})
            cached = sum(cs[0].num_cached_tokens for _, cs in pairs)
            return web.json_response({**base, "choices": out, "usage": usage(n_prompt, all_choices, cached)})
        groups = [cs for _, cs in pairs]
        fmt = _CompletionChunks([c for cs in groups for c in cs], [p[1] for p in prompts] if body.echo else None,
                                body.n, want_lp)
        writer = ChunkWriter(fe, fmt, base=base, groups=groups, n_prompt=n_prompt, include_usage=body.include_usage,
                             continuous_usage=body.continuous_usage)
        return await pump(request, stream, writer, started=started)


@dataclass(slots=True)
class _CompletionChunks:
    """text_completion entries: the echoed prompt first (echo), then text deltas; logprobs'
    text offsets count from the start of each choice's text, echo included."""

    choices: list[ChoiceState]
    echoes: list[str] | None  # per prompt; None: no echo
    n: int
    want_logprobs: bool
    offsets: dict[int, int] = field(default_factory=dict)

    def preamble(self) -> list[dict]:
        if self.echoes is None:
            return []
        out = []
        for c in self.choices:
            echo = self.echoes[c.index // self.n]
            self.offsets[c.index] = len(echo)
            out.append(self._entry(c.index, echo))
        return out

    def delta(self, ev: Delta) -> list[dict]:
        i = ev.choice.index
        lp = completion_logprobs(ev.logprobs, self.offsets.get(i, 0)) if self.want_logprobs else None
        self.offsets[i] = self.offsets.get(i, 0) + len(ev.text)
        return [self._entry(i, ev.text, lp=lp)]

    def finish(self, choice: ChoiceState) -> list[dict]:
        return [{**self._entry(choice.index, "", choice.finish_reason), "stop_reason": choice.stop_reason}]

    @staticmethod
    def _entry(index: int, text: str, finish: str | None = None, lp: dict | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
