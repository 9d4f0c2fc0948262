"""OpenAI request bodies (the fields we honour) and their mapping to SamplingOptions."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moebus.shared.messages import ChatMessage, SamplingOptions, StructuredOptions


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields are tolerated, not honoured


class StreamOptions(_Req):
    include_usage: bool = False


class JsonSchemaFormat(_Req):
    name: str = "schema"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Req):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is json_schema")
        return self


class ContentPart(_Req):
    type: str = "text"
    text: str | None = None


class ChatTurn(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_message(self) -> ChatMessage:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise ValueError("only text content parts are supported")
            content = "".join(p.text or "" for p in content)
        return ChatMessage(role=self.role, content=content, name=self.name)


class _Sampling(_Req):
    """Fields shared by chat and completions (plus vLLM-style extensions: top_k, min_p, ...)."""

    model: str
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and (v == 0 or v < -1):
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return [s for s in stops if s]

    def _structured(self) -> StructuredOptions | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOptions(json_object=True)
        return StructuredOptions(json_schema=rf.json_schema.schema_)

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
        return SamplingOptions(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=list(self.stop or []), stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs, structured=self._structured(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatTurn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def to_sampling(self) -> SamplingOptions:
        n_top = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling(self.max_completion_tokens or self.max_tokens, n_top)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # the completions API's documented default
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
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
        return self.sampling(self.max_tokens, self.logprobs)
