"""The writer of OpenAI's chunk streams (chat and completions): each entry an endpoint's
ChunkFormat makes goes out as a chunk `{**base, "choices": [entry]}`, with the usage when asked for."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ..choices.choice import ChoiceState
from ..errors import APIError
from .events import Delta, Event, Finish
from .formats import usage
from .sse import SSE

if TYPE_CHECKING:
    from ..service import FrontendService


class ChunkFormat(Protocol):
    """The per-endpoint part: the `choices[0]` entry of each chunk."""

    def preamble(self) -> list[dict]:
        """Entries sent right after the headers, before any generated text."""
        ...

    def delta(self, ev: Delta) -> list[dict]:
        """Entries for a delta (none while text is held back, e.g. a tool call's tag arriving)."""
        ...

    def finish(self, choice: ChoiceState) -> list[dict]: ...


class ChunkWriter:
    """A StreamWriter of events (pump.py). groups: the choices of each prompt; continuous_usage
    (vLLM's stream_options.continuous_usage_stats): every chunk carries the usage so far."""

    framing = SSE

    def __init__(self, fe: FrontendService, fmt: ChunkFormat, *, base: dict, groups: Sequence[list[ChoiceState]],
                 n_prompt: int, include_usage: bool, continuous_usage: bool = False) -> None:
        self.fe, self.fmt, self.base, self.groups, self.n_prompt = fe, fmt, base, groups, n_prompt
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.choices = [c for cs in groups for c in cs]

    def preamble(self) -> list[dict]:
        return self._chunks(self.fmt.preamble())

    def step(self, ev: Event) -> list[dict]:
        if isinstance(ev, Delta) and (ev.text or ev.logprobs):
            return self._chunks(self.fmt.delta(ev))
        if isinstance(ev, Finish):
            return self._chunks(self.fmt.finish(ev.choice))
        return []

    def error(self, err: APIError) -> dict:
        return err.body()

    def closing(self) -> list[dict]:
        """The usage chunk when asked for; the stream's tokens counted (only when it ran to its end)."""
        self.fe.m_tokens.inc(sum(c.num_tokens for c in self.choices))
        return [{**self.base, "choices": [], "usage": self._usage()}] if self.include_usage else []

    def _usage(self) -> dict:
        return usage(self.n_prompt, self.choices, sum(cs[0].num_cached_tokens for cs in self.groups))

    def _chunks(self, entries: list[dict]) -> list[dict]:
        extra = {"usage": self._usage()} if self.continuous_usage else {"usage": None} if self.include_usage else {}
        return [{**self.base, "choices": [entry], **extra} for entry in entries]
