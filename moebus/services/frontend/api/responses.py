"""POST /v1/responses: OpenAI's Responses API, stateless (`store` and `previous_response_id` are a
400: nothing is kept between requests). Input as a string or as items (messages, function_call,
function_call_output); function tools; the body or its stream of typed events (response.created,
output_item.added, output_text.delta, function_call_arguments.delta, ..., response.completed)."""
from __future__ import annotations

import time
from typing import Any, Literal

from aiohttp import web
from pydantic import Field, field_validator, model_validator

from moebus.shared.messages import ChatMessage, SamplingOptions, StructuredOptions
from moebus.text.tool_parser_deepseek import Reasoning
from moebus.text.tool_parsers import Call, CallArgs, CallStart, Out, Text

from ..errors import APIError, bad_request
from ..keys import FRONTEND
from ..schema.body import parse_body
from ..schema.fields import ParamError, _Req
from ..schema.guided import JsonSchemaFormat
from ..schema.protocol import ToolCallTurn
from ..schema.tools import Description, FunctionDef, FunctionName, ToolPlan, check_parameters
from ..streams.pump import pump
from ..streams.sse import NamedSSE
from .rendering import ChatPrompt
from .turn import Turn, open_turn


class _Part(_Req):
    type: str = "input_text"
    text: str | None = None


class InputItem(_Req):
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[_Part] | None = None
    call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=64)
    arguments: str | None = None
    output: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        if bad := next((p.type for p in self.content if p.type not in ("input_text", "output_text", "text")), None):
            raise ParamError("input", f"content part type {bad!r} is not supported (input_text, output_text)")
        return "".join(p.text or "" for p in self.content)


class FunctionTool(_Req):
    type: Literal["function"] = "function"
    name: FunctionName
    description: Description = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _schema = field_validator("parameters")(check_parameters)


class _NamedChoice(_Req):
    type: Literal["function"] = "function"
    name: str = Field(max_length=64)


class _TextFormat(JsonSchemaFormat):
    type: Literal["text", "json_object", "json_schema"] = "text"


class _TextConfig(_Req):
    format: _TextFormat | None = None


class ResponsesRequest(_Req):
    model: str = Field(max_length=256)
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    text: _TextConfig | None = None
    metadata: dict[str, str] | None = None

    @model_validator(mode="after")
    def _stateless(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ParamError("previous_response_id", "previous_response_id is not supported: this server keeps no "
                             "responses; send the whole conversation as input")
        if self.store:
            raise ParamError("store", "store is not supported: this server keeps no responses (send store: false)")
        if self.background:
            raise ParamError("background", "background responses are not supported")
        return self

    def plan(self, parser: str) -> ToolPlan:
        choice = self.tool_choice
        named = choice.name if isinstance(choice, _NamedChoice) else None
        tools = [FunctionDef(name=t.name, description=t.description, parameters=t.parameters) for t in self.tools or []]
        return ToolPlan.build(tools, "named" if named else choice, named, parallel=self.parallel_tool_calls,
                              parser=parser)

    def messages(self) -> list[ChatMessage]:
        out = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, ChatMessage(role="user", content=self.input)]
        for item in self.input:
            if item.type == "message":
                out.append(ChatMessage(role=item.role or "user", content=item.text()))
            elif item.type == "function_call":
                tc = ToolCallTurn.model_validate({"id": item.call_id, "function": {
                    "name": item.name or "", "arguments": item.arguments or "{}"}})
                if out and out[-1].role == "assistant" and out[-1].tool_calls is not None:
                    out[-1].tool_calls.append(tc.for_template())
                else:
                    out.append(ChatMessage(role="assistant", tool_calls=[tc.for_template()]))
            else:
                out.append(ChatMessage(role="tool", content=item.output or "", tool_call_id=item.call_id))
        return out

    def sampling(self, plan: ToolPlan) -> SamplingOptions:
        fmt = self.text.format if self.text else None
        own = None
        if fmt is not None and fmt.type == "json_object":
            own = StructuredOptions(json_object=True, param="text.format")
        elif fmt is not None and fmt.type == "json_schema":
            own = StructuredOptions(json_schema=fmt.schema_, param="text.format")
        if own is not None and plan.constraint() is not None:
            raise ParamError("tool_choice", "a required or named tool_choice cannot be combined with text.format")
        return SamplingOptions(temperature=1.0 if self.temperature is None else self.temperature,
                               top_p=1.0 if self.top_p is None else self.top_p, max_tokens=self.max_output_tokens,
                               structured=plan.constraint() or own)


async def responses(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body = await parse_body(request, ResponsesRequest, fe.cfg.limits)
    fe.check_model(body.model)
    try:
        plan = body.plan(fe.cfg.tool_parser(body.model))
        messages, params = body.messages(), body.sampling(plan)
    except ParamError as e:
        raise bad_request(str(e), param=e.param) from None
    prompt = ChatPrompt(messages, plan.template_tools())
    async with open_turn(request, body.model, prompt, params, plan, param="input") as turn:
        view = _Response(body, plan, turn, int(time.time()))
        if not body.stream:
            async for _ in turn.steps():
                pass
            return web.json_response(view.body())
        return await pump(request, turn.steps(), _Events(view))


class _Response:
    """The response object, built from the turn as it goes (for the events) and at its end."""

    def __init__(self, req: ResponsesRequest, plan: ToolPlan, turn: Turn, created: int) -> None:
        self.req, self.plan, self.turn, self.created = req, plan, turn, created
        self.id = "resp_" + turn.request_id

    def body(self, status: str | None = None) -> dict:
        t, done = self.turn, status is None
        status = status or ("incomplete" if t.finish_reason == "length" else "completed")
        tokens = t.choice.num_tokens
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.req.model, "output": self.items() if done else [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
            "parallel_tool_calls": self.plan.parallel, "temperature": self.req.temperature, "top_p": self.req.top_p,
            "tool_choice": _choice(self.req.tool_choice), "store": False, "metadata": self.req.metadata or {},
            "tools": [t.model_dump(exclude_none=True) for t in self.req.tools or []],
            "text": {"format": {"type": "text"}}, "previous_response_id": None,
            "usage": {"input_tokens": t.prompt_tokens, "output_tokens": tokens,
                      "total_tokens": t.prompt_tokens + tokens,
                      "input_tokens_details": {"cached_tokens": t.choice.num_cached_tokens},
                      "output_tokens_details": {"reasoning_tokens": 0}} if done else None,
        }

    def message_id(self, k: int) -> str:
        return f"msg_{self.turn.request_id}_{k}"

    def items(self) -> list[dict]:
        ts = self.turn.tools
        items = [self.message(ts.content, "completed")] if ts.content or not ts.calls else []
        thought = [self.reasoning(r, "completed")] if (r := getattr(ts, "reasoning", "")) else []  # DeepSeek-V4
        return [*thought, *items, *(self.call(c, "completed") for c in ts.calls)]

    def reasoning(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": f"rs_{self.turn.request_id}", "status": status, "summary": [],
                "content": content}

    def message(self, text: str | None, status: str, k: int = 0) -> dict:
        content = [] if text is None else [_text_part(text)]
        return {"type": "message", "id": self.message_id(k), "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def call(c: Call, status: str) -> dict:
        return {"type": "function_call", "id": "fc_" + c.id.removeprefix("call_"), "call_id": c.id, "name": c.name,
                "arguments": c.arguments, "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _choice(choice: Any) -> Any:
    return choice.model_dump() if isinstance(choice, _Req) else (choice or "auto")


class _Events:
    """The stream's writer (streams/pump.py): the response's items as they open and close, a message
    item per run of text, a function_call item per call; every event numbered."""

    framing = NamedSSE

    def __init__(self, view: _Response) -> None:
        self.view = view
        self.seq, self.index, self.messages = 0, -1, 0
        self.open: str | None = None  # "reasoning", "message" or "call"
        self.text = ""
        self.call: Call | None = None

    def preamble(self) -> list[dict]:
        return [self._event("response.created", response=self.view.body("in_progress")),
                self._event("response.in_progress", response=self.view.body("in_progress"))]

    def step(self, outs: list[Out]) -> list[dict]:
        return [e for o in outs for e in self._out(o)]

    def error(self, err: APIError) -> dict:  # as OpenAI sends it
        return self._event("error", code=err.code, message=err.message, param=err.param)

    def closing(self) -> list[dict]:
        events = self._close_item()
        final = self.view.body()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=final)]

    def _event(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _out(self, o: Text | CallStart | CallArgs | Reasoning) -> list[dict]:
        v, ev, out = self.view, self._event, []
        if isinstance(o, Reasoning):  # one reasoning item, before the answer
            if self.open != "reasoning":
                out += self._close_item()
                self.index, self.open = self.index + 1, "reasoning"
                out.append(ev("response.output_item.added", output_index=self.index,
                              item=v.reasoning(None, "in_progress")))
            self.text += o.text
            out.append(ev("response.reasoning_text.delta", item_id=v.reasoning(None, "")["id"],
                          output_index=self.index, content_index=0, delta=o.text))
        elif isinstance(o, Text):
            if self.open != "message":
                out += self._close_item()
                self.index, self.open, self.messages = self.index + 1, "message", self.messages + 1
                out.append(ev("response.output_item.added", output_index=self.index,
                              item=v.message(None, "in_progress", self.messages - 1)))
                out.append(ev("response.content_part.added", item_id=v.message_id(self.messages - 1),
                              output_index=self.index, content_index=0, part=_text_part("")))
            self.text += o.text
            out.append(ev("response.output_text.delta", item_id=v.message_id(self.messages - 1),
                          output_index=self.index, content_index=0, delta=o.text, logprobs=[]))
        elif isinstance(o, CallStart):
            out += self._close_item()
            self.index, self.open, self.call = self.index + 1, "call", v.turn.tools.calls[o.index]
            out.append(ev("response.output_item.added", output_index=self.index,
                          item={**v.call(self.call, "in_progress"), "arguments": ""}))
        elif isinstance(o, CallArgs) and self.call is not None:
            out.append(ev("response.function_call_arguments.delta", item_id=v.call(self.call, "")["id"],
                          output_index=self.index, delta=o.fragment))
        return out

    def _close_item(self) -> list[dict]:
        v, i, ev, out = self.view, self.index, self._event, []
        if self.open == "message":
            item_id = v.message_id(self.messages - 1)
            out = [ev("response.output_text.done", item_id=item_id, output_index=i, content_index=0,
                      text=self.text, logprobs=[]),
                   ev("response.content_part.done", item_id=item_id, output_index=i, content_index=0,
                      part=_text_part(self.text)),
                   ev("response.output_item.done", output_index=i,
                      item=v.message(self.text, "completed", self.messages - 1))]
        elif self.open == "reasoning":
            item = v.reasoning(self.text, "completed")
            out = [ev("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                      text=self.text),
                   ev("response.output_item.done", output_index=i, item=item)]
        elif self.open == "call" and self.call is not None:
            item = v.call(self.call, "completed")
            out = [ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                      arguments=self.call.arguments, name=self.call.name),
                   ev("response.output_item.done", output_index=i, item=item)]
        self.open, self.text = None, ""
        return out
