"""OpenAI request bodies (the fields we honour), their bounds, and their mapping to SamplingOptions.

Static bounds (types, ranges, finite floats, int64 seeds, int32 token ids) live on the fields;
bounds that depend on the deployment come from `RequestLimits`, passed as the validation context
(`model_validate(data, context=limits)`; none given: the defaults). Cross-field violations raise
`ParamError`, so the 400 still names the field.
"""
from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import orjson
from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from moebus.shared.messages import ChatMessage, SamplingOptions
from moebus.shared.messages import ContentPart as WireContentPart

from .fields import INT32_MAX, ParamError, TokenId, _Req, limits_of
from .guided import GuidedFields
from .tools import NamedToolChoice, ToolChoice, ToolDef, ToolPlan, merge_constraint

__all__ = ["ChatCompletionRequest", "CompletionRequest", "ParamError"]
log = logging.getLogger(__name__)
Bias = Annotated[float, Field(ge=-100, le=100)]
MAX_LOGIT_BIAS = 1024  # entries in one logit_bias map

# Fields of the OpenAI / vLLM APIs this server knows but cannot honour: a 400 naming the field when
# one is set to anything but its no-op value (a request that asks for them must not be served as if
# it had not).
_UNSUPPORTED = {
    "functions": bool,  # the deprecated form of tools
    "function_call": lambda v: v not in (None, "none", "auto"),
    "audio": lambda v: v is not None, "prediction": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
    "use_beam_search": bool, "prompt_logprobs": lambda v: v is not None, "bad_words": bool,
    "allowed_token_ids": lambda v: v is not None, "truncate_prompt_tokens": lambda v: v is not None,
    "skip_special_tokens": lambda v: v is False, "spaces_between_special_tokens": lambda v: v is False,
    "return_tokens_as_token_ids": bool, "guided_whitespace_pattern": lambda v: v is not None,
    "cache_salt": lambda v: v is not None, "priority": bool, "logits_processors": bool, "echo": bool,
    "documents": bool, "return_token_ids": bool,
}
# Known fields that change nothing here: accepted without a warning.
_NO_EFFECT = frozenset({"store", "metadata", "service_tier", "guided_decoding_backend",
                        "request_id"})


class StreamOptions(_Req):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk too (with include_usage)


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
    tool_calls: list[ToolCallTurn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = Field(None, max_length=256)  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's reasoning, given back (DeepSeek-V4 renders it)

    def to_message(self, image_urls: list[str]) -> ChatMessage:
        """The wire message; the URLs of its image parts are appended to image_urls, in order."""
        msg = self._message(image_urls)
        if self.tool_calls:
            msg.tool_calls = [c.for_template() for c in self.tool_calls]
        msg.tool_call_id = self.tool_call_id
        msg.reasoning_content = self.reasoning_content if self.role == "assistant" else None
        return msg

    def _message(self, image_urls: list[str]) -> ChatMessage:
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


class _CalledFunction(_Req):
    name: str = Field(max_length=64)
    arguments: str | dict[str, Any] = "{}"


class ToolCallTurn(_Req):
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: _CalledFunction

    def for_template(self) -> dict:
        """Arguments as an object where the JSON parses: templates render them with tojson."""
        args: Any = self.function.arguments
        if isinstance(args, str):
            try:
                args = orjson.loads(args) if args.strip() else {}
            except ValueError:  # lone surrogates ("\\ud800") included: they would break the tokenizer
                pass  # not JSON: the template gets the text as it came
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class _Sampling(GuidedFields):
    """Fields shared by chat and completions (plus vLLM-style extensions: top_k, min_p, ...).
    Unknown top-level fields are kept only to be named in one warning line, then ignored."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

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
    logit_bias: dict[TokenId, Bias] | None = None  # token id (a JSON key: its digits) -> bias
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

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is not None and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
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
        self._check_extra()
        return self

    def _check_extra(self) -> None:
        extra = self.model_extra or {}
        for name, value in extra.items():
            if name in _UNSUPPORTED and _UNSUPPORTED[name](value):
                raise ParamError(name, f"{name} is not supported by this server")
        if unknown := sorted(k[:64] for k in extra if k not in _UNSUPPORTED and k not in _NO_EFFECT)[:32]:
            log.warning("The following fields were present in the request but ignored: %s", unknown)

    def max_output_tokens(self) -> tuple[int | None, str]:
        """The completion's token budget and the field it came from."""
        return self.max_tokens, "max_tokens"

    def sampling(self, logprobs: int | None) -> SamplingOptions:
        return SamplingOptions(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0, seed=self.seed, max_tokens=self.max_output_tokens()[0],
            min_tokens=self.min_tokens, stop=list(self.stop or []), stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logprobs=logprobs, structured=self.structured(), logit_bias=dict(self.logit_bias or {}),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class ChatCompletionRequest(_Sampling):
    messages: list[ChatTurn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    # The chat template (vLLM's extensions): continue_final_message renders the last message open
    # (no generation prompt, its end-of-turn left off) for the model to go on with it.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    reasoning_effort: str | None = Field(None, max_length=32)  # given to the template as reasoning_effort
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None  # default: auto with tools, none without
    parallel_tool_calls: bool | None = None  # false: at most one call

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

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and (taken := sorted(set(v) & _TEMPLATE_OWN)):
            raise ValueError(f"{taken[0]} is set by the server, not through chat_template_kwargs")
        return v

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError("continue_final_message", "continue_final_message needs add_generation_prompt "
                             "set to false")
        if self.continue_final_message and not isinstance(self.messages[-1].content, str | list):
            raise ParamError("continue_final_message", "continue_final_message needs a last message with content")
        merge_constraint(self.tool_plan(), self.structured())
        return self

    def tool_plan(self, parser: str = "hermes") -> ToolPlan:
        choice = self.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return ToolPlan.build([t.function for t in self.tools or []], "named" if named else choice, named,
                              parallel=self.parallel_tool_calls, parser=parser)

    def template_kwargs(self) -> dict[str, Any]:
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        return out

    def max_output_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def to_sampling(self, plan: ToolPlan | None = None) -> SamplingOptions:
        params = self.sampling((self.top_logprobs or 0) if self.logprobs else None)
        params.structured = merge_constraint(plan or self.tool_plan(), params.structured)
        return params


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

    @model_validator(mode="after")
    def _echo(self) -> CompletionRequest:
        # OpenAI's echo + logprobs includes the prompt tokens' logprobs, which the engine does not compute.
        if self.echo and self.logprobs is not None:
            raise ParamError("echo", "echo with logprobs needs the prompt's logprobs, which this server does not "
                             "compute; ask for one of them")
        return self

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


_TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "continue_final_message"})


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
