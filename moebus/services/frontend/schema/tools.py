"""Function tools of a request: their definitions, tool_choice, and what they change.

`ToolPlan` is what every API (chat, Responses, Anthropic Messages) builds from its own request
shape: the tools the chat template renders into the prompt, the constraint that enforces
`required` (a JSON array of calls, one `anyOf` branch per tool) or a named function (its
parameters' schema) through the structured-output path, and the ToolStream that reads each
choice's text back into content and calls (moebus/text/tool_parsers.py; `auto` uses the model's parser).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from moebus.shared.messages import StructuredOptions
from moebus.text.tool_parser_deepseek import RECIPE_PARSERS, DeepSeekV4Parser, thinking_of
from moebus.text.tool_parsers import (
    PARSERS,
    CallArray,
    HermesParser,
    NamedCall,
    PlainText,
    ToolStream,
    new_call_id,
)

from .fields import ParamError, _Req
from .guided import check_schema

MAX_TOOLS = 128
Mode = Literal["none", "auto", "required", "named"]
# OpenAI's rule for function names: letters, digits, _ . : -, at most 64 (every API's tools use it)
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
Description = Annotated[str | None, Field(None, max_length=8192)]


def check_parameters(v: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
    """A tool's parameters: a JSON schema within the deployment's bounds (guided.check_schema)."""
    return None if v is None else check_schema(v, info)


class FunctionDef(_Req):
    name: FunctionName
    description: Description = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    _schema = field_validator("parameters")(check_parameters)

    def for_template(self) -> dict:
        return {"type": "function", "function": self.model_dump(exclude_none=True)}


class ToolDef(_Req):
    type: Literal["function"] = "function"
    function: FunctionDef


class _FunctionName(_Req):
    name: str = Field(max_length=64)


class NamedToolChoice(_Req):
    type: Literal["function"] = "function"
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: tuple[FunctionDef, ...] = ()
    mode: Mode = "none"
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str = "hermes"  # the model's tool-call parser (auto)

    @classmethod
    def build(cls, tools: list[FunctionDef] | None, choice: str | None, name: str | None = None, *,
              parallel: bool | None = True, parser: str = "hermes", param: str = "tool_choice") -> ToolPlan:
        """tools + (choice: none/auto/required, or "named" with `name`); default: auto with tools."""
        tools = list(tools or [])
        if len(tools) > MAX_TOOLS:
            raise ParamError("tools", f"at most {MAX_TOOLS} tools")
        if len({t.name for t in tools}) != len(tools):
            raise ParamError("tools", "tool names must be unique")
        mode = choice or ("auto" if tools else "none")
        if mode in ("required", "named") and not tools:
            raise ParamError(param, f"tool_choice {mode!r} needs tools")
        if mode == "named" and name not in {t.name for t in tools}:
            raise ParamError(param, f"tool_choice names {name!r}, which is not among the tools")
        if mode == "auto" and tools and parser not in PARSERS and parser not in RECIPE_PARSERS:
            raise ParamError(param, f"no tool-call parser {parser!r} for this model")
        return cls(tuple(tools), mode, name, parallel is not False, parser)

    def template_tools(self) -> list[dict] | None:
        return [t.for_template() for t in self.tools] or None

    def constraint(self) -> StructuredOptions | None:
        if self.mode == "named":
            return StructuredOptions(json_schema=_arguments_schema(self._tool(self.name)), param="tools")
        if self.mode == "required":
            calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]},
                                                  "arguments": _arguments_schema(t)},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]}}
            if not self.parallel:
                calls["maxItems"] = 1
            return StructuredOptions(json_schema=calls, param="tools")
        return None

    def stream(self, new_id: Any = new_call_id, template_kwargs: dict | None = None) -> ToolStream:
        """A fresh ToolStream for one choice (template_kwargs: a DeepSeek-V4 prompt's thinking mode)."""
        most = None if self.parallel else 1
        if self.mode == "named":
            return NamedCall(new_id, most, name=self.name or "")
        if self.mode == "required":
            return CallArray(new_id, most)
        if self.parser in RECIPE_PARSERS:  # every turn: the reasoning is parsed out even without tools
            return DeepSeekV4Parser(new_id, most, version=self.parser, thinking=thinking_of(template_kwargs or {}),
                                    parse_calls=self.mode == "auto" and bool(self.tools))
        if self.mode == "auto" and self.tools:
            return PARSERS.get(self.parser, HermesParser)(new_id, most)
        return PlainText(new_id, most)

    def _tool(self, name: str | None) -> FunctionDef:
        return next(t for t in self.tools if t.name == name)


def _arguments_schema(tool: FunctionDef) -> dict[str, Any]:
    return tool.parameters if tool.parameters else {"type": "object"}


def finish_reason(reason: str | None, stream: ToolStream) -> str | None:
    """A turn that ended on its own after calling functions ended for them (OpenAI's `tool_calls`)."""
    return "tool_calls" if stream.calls and reason == "stop" else reason


def merge_constraint(plan: ToolPlan, other: StructuredOptions | None) -> StructuredOptions | None:
    """The tool constraint, or the request's own: not both."""
    mine = plan.constraint()
    if mine is not None and other is not None:
        raise ParamError("tool_choice", "a required or named tool_choice cannot be combined with another output "
                         "constraint (response_format, structured_outputs, guided_*)")
    return mine or other
