"""What the engine reports: per-step request outputs and step counters."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one choice of a request (satisfies moebus.engine.port.EngineOutput)."""

    request_id: str  # as given to add_request
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # finish_reason "error": what failed
    retryable: bool = False  # the error was the step's, not this request's: another engine may run it
    error_param: str | None = None  # the error is the request's own (a 400): the request field at fault
    index: int = 0  # the choice (0 .. n-1) of an n > 1 request
    stop_reason: int | str | None = None  # finished by a stop token id or stop string: which (eos: None)


@dataclass(slots=True)
class EngineStats:
    """Step counters; step_seconds is model execution time per step."""

    steps: int = 0
    tokens_computed: int = 0
    step_seconds: list[float] = field(default_factory=list)
