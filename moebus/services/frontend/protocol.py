"""OpenAI request bodies (the fields we honour), their bounds, and their mapping to SamplingOptions.

Static bounds (types, ranges, finite floats, int64 seeds, int32 token ids) live on the fields;
bounds that depend on the deployment come from `RequestLimits`, passed as the validation context
(`model_validate(data, context=limits)`; none given: the defaults). Cross-field violations raise
`ParamError`, so the 400 still names the field.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from moebus.shared.messages import ChatMessage, SamplingOptions, StructuredOptions
from moebus.shared.messages import ContentPart as WireContentPart

from .config import RequestLimits

INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the engine's token tensors are int32/int64
_DEFAULT_LIMITS = RequestLimits()


class ParamError(ValueError):
    """A violation that involves several fields: `param` names the one to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def limits_of(info: ValidationInfo) -> RequestLimits:
    return info.context if isinstance(info.context, RequestLimits) else _DEFAULT_LIMITS


class _Req(BaseModel):
    # Unknown OpenAI fields are tolerated, not honoured; NaN and +-inf are never a valid number.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Req):
    include_usage: bool = False


class JsonSchemaFormat(_Req):
    name: str = Field("schema", max_length=256)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        lim = limits_of(info)
        if _depth(v) > lim.max_schema_depth:
            raise ValueError(f"the schema nests deeper than {lim.max_schema_depth} levels")
        if len(orjson.dumps(v)) > lim.max_schema_bytes:
            raise ValueError(f"the schema is larger than {lim.max_schema_bytes} bytes as JSON")
        return v


class ResponseFormat(_Req):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is json_schema")
        return self


class ImageURL(_Req):
    url: str = Field(max_length=64 << 20)  # a data URL carries the whole image
    detail: Literal["auto", "low", "high"] | None = None  # accepted; one view per image either way


class ContentPart(_Req):
    type: str = "text"
    text: str | None = None
    image_url: ImageURL | None = None


class ChatTurn(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=256)

    def to_message(self, image_urls: list[str]) -> ChatMessage:
        """The wire message; the URLs of its image parts are appended to image_urls, in order."""
        content = self.content
        if not isinstance(content, list):
            return ChatMessage(role=self.role, content=content, name=self.name)
        parts = []
        for p in content:
            if p.type == "text":
                parts.append(WireContentPart(text=p.text or ""))
            elif p.type == "image_url":
                if p.image_url is None:
                    raise ValueError("an image_url content part needs image_url.url")
                image_urls.append(p.image_url.url)
                parts.append(WireContentPart(type="image"))
            else:
                raise ValueError(f"content part type {p.type!r} is not supported (text, image_url)")
        if not any(p.type == "image" for p in parts):  # text only: one string, as templates expect
            return ChatMessage(role=self.role, content="".join(p.text or "" for p in parts), name=self.name)
        return ChatMessage(role=self.role, content=parts, name=self.name)


class _Sampling(_Req):
    """Fields shared by chat and completions (plus vLLM-style extensions: top_k, min_p, ...)."""

    model: str = Field(max_length=256)
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False  # vLLM's extension: the matched stop string ends the text
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int, info: ValidationInfo) -> int:
        if v > (most := limits_of(info).max_n):
            raise ValueError(f"n must be <= {most}")
        return v

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _max_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v > (most := limits_of(info).max_model_len):
            raise ValueError(f"must be <= {most}, the model's maximum context length")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any, info: ValidationInfo) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        lim = limits_of(info)
        if len(stops) > lim.max_stop_sequences:
            raise ValueError(f"at most {lim.max_stop_sequences} stop sequences")
        if any(len(s) > lim.max_stop_chars for s in stops):
            raise ValueError(f"each stop sequence must be at most {lim.max_stop_chars} characters")
        return [s for s in stops if s]

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if v is not None and len(v) > (most := limits_of(info).max_stop_token_ids):
            raise ValueError(f"at most {most} stop token ids")
        return v

    @model_validator(mode="after")
    def _cross_fields(self, info: ValidationInfo) -> _Sampling:
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", "best_of must equal n: best_of > n is not supported")
        max_tokens, name = self.max_output_tokens()
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ParamError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= {name} ({max_tokens})")
        if self.min_tokens > (most := limits_of(info).max_model_len):
            raise ParamError("min_tokens", f"min_tokens must be <= {most}, the model's maximum context length")
        return self

    def max_output_tokens(self) -> tuple[int | None, str]:
        """The completion's token budget and the field it came from."""
        return self.max_tokens, "max_tokens"

    def _structured(self) -> StructuredOptions | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOptions(json_object=True)
        return StructuredOptions(json_schema=rf.json_schema.schema_)

    def sampling(self, logprobs: int | None) -> SamplingOptions:
        return SamplingOptions(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0, seed=self.seed, max_tokens=self.max_output_tokens()[0],
            min_tokens=self.min_tokens, stop=list(self.stop or []), stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logprobs=logprobs, structured=self._structured(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatTurn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatTurn], info: ValidationInfo) -> list[ChatTurn]:
        if len(v) > (most := limits_of(info).max_messages):
            raise ValueError(f"at most {most} messages")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v > (most := limits_of(info).max_logprobs):
            raise ValueError(f"must be <= {most}")
        return v

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    def max_output_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def to_sampling(self) -> SamplingOptions:
        return self.sampling((self.top_logprobs or 0) if self.logprobs else None)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)  # the completions API's documented default
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any, info: ValidationInfo) -> Any:
        """Checked by hand: a union's own errors would blame its first member (`prompt.str`)."""
        if isinstance(v, str):
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("prompt must be a string, a list of strings, token ids, or lists of token ids")
        if len(v) > (most := limits_of(info).max_prompts) and not all(_is_int(x) for x in v):
            raise ValueError(f"at most {most} prompts in one request")
        if all(isinstance(x, str) for x in v):
            return v
        token_lists = [v] if all(_is_int(x) for x in v) else v
        for ids in token_lists:
            if not isinstance(ids, list) or not ids or not all(_is_int(x) for x in ids):
                raise ValueError("prompt must be a string, a list of strings, token ids, or lists of token ids")
            if not all(0 <= x <= INT32_MAX for x in ids):
                raise ValueError(f"prompt token ids must be in [0, {INT32_MAX}]")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v > (most := limits_of(info).max_logprobs):
            raise ValueError(f"must be <= {most}")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def to_sampling(self) -> SamplingOptions:
        return self.sampling(self.logprobs)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _depth(obj: Any) -> int:
    """Nesting depth of a JSON value, without recursion."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        node, d = todo.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in (node.values() if isinstance(node, dict) else node))
    return deepest
