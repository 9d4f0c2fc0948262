"""Per-request sampling parameters (the engine-side mirror of OpenAI's request fields)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# Bounds that keep every value representable in the engine's int32/int64 tensors; the context
# length bounds token counts long before these do.
MAX_TOKENS = 2**31 - 1
MAX_TOKEN_ID = 2**31


@dataclass(slots=True)
class StructuredOutputParams:
    """Exactly one constraint; compiled by engine.sampling.structured into a token bitmask."""

    json_schema: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-like; the start rule is `root`)
    param: str | None = None  # the request field it came from (e.g. guided_regex): errors name it

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.json_schema, self.regex, self.choice, self.grammar))
        given += int(self.json_object)
        if given != 1:
            raise ValueError("structured output needs exactly one of json_schema, json_object, regex, choice, "
                             "grammar")
        if self.choice is not None and not self.choice:
            raise ValueError("choice must list at least one option")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-n logprobs per generated token; 0 = only the sampled token
    structured: StructuredOutputParams | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if not 0 <= self.min_tokens <= MAX_TOKENS:
            raise ValueError(f"min_tokens must be in [0, {MAX_TOKENS}], got {self.min_tokens}")
        if self.max_tokens is not None and not self.min_tokens <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens must be in [min_tokens, {MAX_TOKENS}], got {self.max_tokens}")
        if any(not 0 <= t < MAX_TOKEN_ID for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {MAX_TOKEN_ID})")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.top_k > MAX_TOKEN_ID:
            raise ValueError(f"top_k must be at most {MAX_TOKEN_ID}, got {self.top_k}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not 0 <= t < MAX_TOKEN_ID for t in self.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {MAX_TOKEN_ID})")
        if any(not (math.isfinite(b) and -100 <= b <= 100) for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    def for_choice(self, index: int) -> SamplingParams:
        """Parameters of choice `index` of an n > 1 request: one choice, seeded seed + index."""
        if self.n == 1:
            return self
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
