"""POST /v1/chat/completions (streamed over SSE, or one JSON body), with function tools."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from moebus.shared.errors import ServiceError
from moebus.text.tool_parser_deepseek import Reasoning
from moebus.text.tool_parsers import CallArgs, CallStart, Out, PlainText, Text, ToolStream

from ..choices.choice import ChoiceState
from ..errors import APIError, bad_request
from ..keys import FRONTEND, TENANT
from ..schema.body import parse_body
from ..schema.fields import ParamError
from ..schema.protocol import ChatCompletionRequest
from ..schema.tools import ToolPlan, finish_reason
from ..streams.chunks import ChunkWriter
from ..streams.events import Delta, Event, events
from ..streams.formats import chat_logprobs, usage
from ..streams.pump import pump
from .rendering import ChatPrompt, render_chat


async def chat_completions(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body = await parse_body(request, ChatCompletionRequest, fe.cfg.limits)
    fe.check_model(body.model)
    try:
        plan = body.tool_plan(fe.cfg.tool_parser(body.model))
    except ParamError as e:
        raise bad_request(str(e), param=e.param) from None
    urls: list[str] = []
    try:
        messages = [t.to_message(urls) for t in body.messages]
    except ValueError as e:
        raise bad_request(str(e), param="messages") from None
    params = body.to_sampling(plan)
    prompt, images = await render_chat(fe, body.model, ChatPrompt(
        messages, plan.template_tools(), urls, body.add_generation_prompt, body.continue_final_message,
        body.template_kwargs()), params.max_tokens)
    started = time.monotonic()
    async with fe.generation(body.model, prompt, params, images, request.get(TENANT)) as gen:
        choices = fe.choices(0, params, prompt, body.model)
        # a continued assistant message goes on with its answer, not a new reasoning (DeepSeek-V4)
        parse_kw = {**body.template_kwargs(), "thinking": False} if body.continue_final_message else body.template_kwargs()
        tools = {c.index: plan.stream(template_kwargs=parse_kw) for c in choices}
        base = {"id": "chatcmpl-" + gen.request_id[4:], "created": int(time.time()), "model": body.model}
        stream = events([(gen, choices)])
        if not body.stream:
            async for ev in _with_errors(stream):
                if isinstance(ev, Delta):
                    tools[ev.choice.index].feed(ev.text)
            for ts in tools.values():
                ts.finish()
            fe.m_tokens.inc(sum(c.num_tokens for c in choices))
            return web.json_response({
                **base, "object": "chat.completion", "system_fingerprint": None,
                "choices": [{"index": c.index, "message": _message(tools[c.index], plan),
                             "logprobs": chat_logprobs(c.logprobs) if params.logprobs is not None else None,
                             "finish_reason": finish_reason(c.finish_reason, tools[c.index]),
                             "stop_reason": c.stop_reason} for c in choices],
                "usage": usage(len(prompt), choices, choices[0].num_cached_tokens),
            })
        base = {**base, "object": "chat.completion.chunk", "system_fingerprint": None}
        writer = ChunkWriter(fe, _ChatChunks(choices, params.logprobs is not None, tools), base=base,
                             groups=[choices], n_prompt=len(prompt), include_usage=body.include_usage,
                             continuous_usage=body.continuous_usage)
        return await pump(request, stream, writer, started=started)


def _message(ts: ToolStream, plan: ToolPlan) -> dict:
    reasoning = {"reasoning_content": r} if (r := getattr(ts, "reasoning", None)) else {}  # DeepSeek-V4
    if not ts.calls:
        return {"role": "assistant", "content": ts.content, **reasoning}
    return {"role": "assistant", "content": ts.content or None, **reasoning,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in ts.calls]}


async def _with_errors(stream: AsyncIterator[Event]) -> AsyncIterator[Event]:
    try:
        async for ev in stream:
            yield ev
    except ServiceError as e:
        raise APIError.from_service_error(e) from None


@dataclass(slots=True)
class _ChatChunks:
    """chat.completion.chunk entries: the assistant role first, then content and tool-call deltas
    (a call's first delta carries its id, type and name; the next ones pieces of its arguments)."""

    choices: list[ChoiceState]
    want_logprobs: bool
    tools: dict[int, ToolStream] = field(default_factory=dict)  # per choice; none given: plain text

    def preamble(self) -> list[dict]:
        return [self._entry(c.index, {"role": "assistant", "content": ""}) for c in self.choices]

    def delta(self, ev: Delta) -> list[dict]:
        lp = chat_logprobs(ev.logprobs) if self.want_logprobs else None
        entries = [self._entry(ev.choice.index, d) for d in _deltas(self._tools(ev.choice.index).feed(ev.text))]
        if lp is not None:
            if not entries:
                entries = [self._entry(ev.choice.index, {"content": ""})]
            entries[0]["logprobs"] = lp
        return entries

    def finish(self, choice: ChoiceState) -> list[dict]:
        ts = self._tools(choice.index)
        entries = [self._entry(choice.index, d) for d in _deltas(ts.finish())]
        return [*entries, {**self._entry(choice.index, {}, finish_reason(choice.finish_reason, ts)),
                           "stop_reason": choice.stop_reason}]

    def _tools(self, index: int) -> ToolStream:
        return self.tools.setdefault(index, PlainText())

    @staticmethod
    def _entry(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def _deltas(outs: list[Out]) -> list[dict]:
    """Chat deltas for a step's outs: text runs merged, one delta per call piece."""
    deltas: list[dict] = []
    for o in outs:
        if isinstance(o, Text):
            if deltas and "content" in deltas[-1]:
                deltas[-1]["content"] += o.text
            else:
                deltas.append({"content": o.text})
        elif isinstance(o, Reasoning):
            deltas.append({"reasoning_content": o.text})
        elif isinstance(o, CallStart):
            deltas.append({"tool_calls": [{"index": o.index, "id": o.id, "type": "function",
                                           "function": {"name": o.name, "arguments": ""}}]})
        elif isinstance(o, CallArgs):
            deltas.append({"tool_calls": [{"index": o.index, "function": {"arguments": o.fragment}}]})
    return deltas
