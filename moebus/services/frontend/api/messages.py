"""Anthropic's Messages API: POST /v1/messages (a body, or its stream of message_start,
content_block_start/delta/stop, message_delta, message_stop events) and POST
/v1/messages/count_tokens. Text and tool_use / tool_result blocks; tools with input_schema and
tool_choice auto / any / tool / none. Errors come in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`)."""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from aiohttp import web
from pydantic import Field, ValidationInfo, field_validator

from moebus.shared.errors import ServiceError
from moebus.shared.messages import ChatMessage, SamplingOptions
from moebus.text.tool_parser_deepseek import RECIPE_PARSERS, Reasoning
from moebus.text.tool_parsers import CallArgs, CallStart, Out, Text

from ..errors import APIError, bad_request
from ..keys import FRONTEND
from ..schema.body import parse_body
from ..schema.fields import ParamError, _Req, limits_of
from ..schema.tools import Description, FunctionDef, FunctionName, ToolPlan, check_parameters
from ..streams.pump import pump
from ..streams.sse import NamedSSE
from .rendering import ChatPrompt, render_chat
from .turn import Turn, open_turn

_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}
_STOP = {"length": "max_tokens", "tool_calls": "tool_use"}


class Block(_Req):
    type: str
    text: str | None = None
    id: str | None = Field(None, max_length=256)  # tool_use
    name: str | None = Field(None, max_length=64)
    input: dict[str, Any] | None = None
    tool_use_id: str | None = Field(None, max_length=256)  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None

    def plain(self) -> str:
        if self.type != "text":
            raise ParamError("messages", f"content block type {self.type!r} is not supported here "
                             "(text, tool_use, tool_result)")
        return self.text or ""


class AMessage(_Req):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def to_chat(self) -> list[ChatMessage]:
        """One chat message, or (a user turn with tool results) a tool message per result first."""
        if isinstance(self.content, str):
            return [ChatMessage(role=self.role, content=self.content)]
        out, text, calls = [], "", []
        for b in self.content:
            if b.type == "tool_result":
                body = b.content if isinstance(b.content, str) or b.content is None else \
                    "".join(x.plain() for x in b.content)
                out.append(ChatMessage(role="tool", content=body or "", tool_call_id=b.tool_use_id))
            elif b.type == "tool_use" and self.role == "assistant":
                calls.append({"id": b.id, "type": "function", "function": {"name": b.name or "",
                                                                           "arguments": b.input or {}}})
            else:
                text += b.plain()
        if text or calls or not out:
            out.append(ChatMessage(role=self.role, content=text or None, tool_calls=calls or None))
        return out


class ATool(_Req):
    name: FunctionName
    description: Description = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})

    _schema = field_validator("input_schema")(check_parameters)


class AToolChoice(_Req):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _Conversation(_Req):
    model: str = Field(max_length=256)
    messages: list[AMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    thinking: dict[str, Any] | None = None  # extended thinking: DeepSeek-V4 only (else a 400 when enabled)

    def thinks(self) -> bool:
        return bool(self.thinking) and self.thinking.get("type") not in (None, "disabled")

    @field_validator("messages")
    @classmethod
    def _count(cls, v: list[AMessage], info: ValidationInfo) -> list[AMessage]:
        if len(v) > (most := limits_of(info).max_messages):
            raise ValueError(f"at most {most} messages")
        return v

    def plan(self, parser: str) -> ToolPlan:
        tc = self.tool_choice or AToolChoice()
        choice = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[tc.type]
        if tc.type == "auto" and not self.tools:
            choice = None
        tools = [FunctionDef(name=t.name, description=t.description, parameters=t.input_schema)
                 for t in self.tools or []]
        return ToolPlan.build(tools, choice, tc.name, parallel=not tc.disable_parallel_tool_use, parser=parser)

    def prompt(self, plan: ToolPlan) -> ChatPrompt:
        system = self.system if isinstance(self.system, str) or self.system is None else \
            "".join(b.plain() for b in self.system)
        msgs = [ChatMessage(role="system", content=system)] if system else []
        for m in self.messages:
            msgs += m.to_chat()
        return ChatPrompt(msgs, plan.template_tools())


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    def sampling(self, plan: ToolPlan) -> SamplingOptions:
        return SamplingOptions(temperature=1.0 if self.temperature is None else self.temperature,
                               top_p=self.top_p or 1.0, top_k=self.top_k or -1, max_tokens=self.max_tokens,
                               stop=[s for s in self.stop_sequences or [] if s], structured=plan.constraint())


async def messages(request: web.Request) -> web.StreamResponse:
    try:
        return await _messages(request)
    except (APIError, ServiceError) as e:
        return anthropic_error(e)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    try:
        fe = request.app[FRONTEND]
        body = await parse_body(request, _Conversation, fe.cfg.limits)
        fe.check_model(body.model)
        plan, prompt = _prepare(body, fe.cfg.tool_parser(body.model))
        ids, _ = await render_chat(fe, body.model, prompt, None)
        return web.json_response({"input_tokens": len(ids)})
    except (APIError, ServiceError) as e:
        return anthropic_error(e)


def anthropic_error(e: APIError | ServiceError) -> web.Response:
    e = APIError.from_service_error(e) if isinstance(e, ServiceError) else e
    kind = _ERROR_TYPE.get(e.status, "api_error")
    headers = {"Retry-After": str(int(max(1, e.retry_after)))} if e.retry_after else None
    return web.json_response({"type": "error", "error": {"type": kind, "message": e.message}}, status=e.status,
                             headers=headers)


def _prepare(body: _Conversation, parser: str) -> tuple[ToolPlan, ChatPrompt]:
    try:
        plan = body.plan(parser)
        prompt = body.prompt(plan)
    except ParamError as e:
        raise bad_request(str(e), param=e.param) from None
    if plan.parser in RECIPE_PARSERS:  # off unless asked for, as Anthropic's models
        prompt.template_kwargs = {"thinking": body.thinks()}
    elif body.thinks():
        raise bad_request("extended thinking is not supported by this model", param="thinking")
    return plan, prompt


async def _messages(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body = await parse_body(request, MessagesRequest, fe.cfg.limits)
    fe.check_model(body.model)
    plan, prompt = _prepare(body, fe.cfg.tool_parser(body.model))
    params = body.sampling(plan)
    async with open_turn(request, body.model, prompt, params, plan, new_id=_tool_id) as turn:
        if not body.stream:
            async for _ in turn.steps():
                pass
            return web.json_response({**_message(body, turn), "content": _blocks(turn), **_stop(turn),
                                      "usage": _usage(turn)})
        return await pump(request, turn.steps(), _Events(body, turn))


def _tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _message(body: MessagesRequest, turn: Turn) -> dict:
    return {"id": "msg_" + turn.request_id, "type": "message", "role": "assistant", "model": body.model}


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _blocks(turn: Turn) -> list[dict]:
    ts = turn.tools
    text = [{"type": "text", "text": ts.content}] if ts.content or not ts.calls else []
    thought = [{"type": "thinking", "thinking": r, "signature": ""}] if (r := getattr(ts, "reasoning", "")) else []
    return [*thought, *text, *({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)}
                     for c in ts.calls)]


def _stop(turn: Turn) -> dict:
    reason, matched = turn.finish_reason, turn.choice.stop_reason
    if reason in _STOP:
        return {"stop_reason": _STOP[reason], "stop_sequence": None}
    if isinstance(matched, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(turn: Turn) -> dict:
    return {"input_tokens": turn.prompt_tokens, "output_tokens": turn.choice.num_tokens,
            "cache_read_input_tokens": turn.choice.num_cached_tokens, "cache_creation_input_tokens": 0}


class _Events:
    """The stream's writer (streams/pump.py): message_start, a content block per run of thinking or
    text and per tool call, message_delta (the stop reason) and message_stop."""

    framing = NamedSSE

    def __init__(self, body: MessagesRequest, turn: Turn) -> None:
        self.body, self.turn = body, turn
        self.index, self.kind = -1, None  # the open content block

    def preamble(self) -> list[dict]:
        return [{"type": "message_start", "message": {
            **_message(self.body, self.turn), "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**_usage(self.turn), "output_tokens": 0}}}]

    def step(self, outs: list[Out]) -> list[dict]:
        return [e for o in outs for e in self._out(o)]

    def error(self, err: APIError) -> dict:  # as Anthropic sends it
        return {"type": "error", "error": {"type": _ERROR_TYPE.get(err.status, "api_error"), "message": err.message}}

    def closing(self) -> list[dict]:
        return [*self._stop_block(), {"type": "message_delta", "delta": _stop(self.turn),
                                      "usage": {"output_tokens": self.turn.choice.num_tokens}},
                {"type": "message_stop"}]

    def _out(self, o: Out | Reasoning) -> list[dict]:
        if isinstance(o, Reasoning):  # DeepSeek-V4 with thinking enabled
            return [*self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""}),
                    {"type": "content_block_delta", "index": self.index,
                     "delta": {"type": "thinking_delta", "thinking": o.text}}]
        if isinstance(o, Text):
            return [*self._start("text", {"type": "text", "text": ""}),
                    {"type": "content_block_delta", "index": self.index,
                     "delta": {"type": "text_delta", "text": o.text}}]
        if isinstance(o, CallStart):  # a block per call, even after another call
            return [*self._stop_block(), *self._start("tool_use", {
                "type": "tool_use", "id": o.id, "name": o.name, "input": {}})]
        if isinstance(o, CallArgs):
            return [{"type": "content_block_delta", "index": self.index,
                     "delta": {"type": "input_json_delta", "partial_json": o.fragment}}]
        return []

    def _start(self, kind: str, block: dict) -> list[dict]:
        """A new content block unless one of this kind is open."""
        if self.kind == kind:
            return []
        out = self._stop_block()
        self.index, self.kind = self.index + 1, kind
        return [*out, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _stop_block(self) -> list[dict]:
        out = [{"type": "content_block_stop", "index": self.index}] if self.kind is not None else []
        self.kind = None
        return out
