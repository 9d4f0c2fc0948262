"""Per-choice output state: text (from the worker, or detokenized via the tokenizer service),
stop strings when the frontend detokenizes, logprobs, finish reason, token counts."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from moebus.shared.bus import Bus
from moebus.shared.messages import DetokenizeReply, DetokenizeRequest, TokenChunk, TokenLogprob
from moebus.shared.subjects import Subjects

_CONTEXT = 6  # prompt tokens given to the detokenizer as left context


@dataclass
class Detok:
    """Client half of the tokenizer service's stateless detokenization (window + offsets)."""

    bus: Bus
    subjects: Subjects
    model: str
    timeout: float
    stop: list[str]
    include_stop: bool
    context: list[int] = field(default_factory=list)  # last prompt tokens: the first decode's left context
    wait_s: float = 0.0  # how long to wait for a tokenizer while none answers (one is restarting)
    paused_s: float = 0.0  # how long to keep asking one that is there but silent (paused)
    window: list[int] = field(default_factory=list)
    read_offset: int = 0
    held: str = ""
    matched: str | None = None  # the stop string that ended the choice
    calls: int = 0  # tokenizer calls so far, their first start and last end (ns) and total wait: its span
    first_ns: int = 0
    last_ns: int = 0
    busy_ns: int = 0

    def __post_init__(self) -> None:
        self.context = list(self.context[-_CONTEXT:])
        if not self.window:
            self.window, self.read_offset = list(self.context), len(self.context)

    async def push(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        self.window += token_ids
        req = DetokenizeRequest(model=self.model, token_ids=self.window, read_offset=self.read_offset,
                                held=self.held, stop=self.stop, include_stop=self.include_stop, finished=finished)
        started = time.time_ns()
        reply = await self.bus.request(self.subjects.tokenizer_detokenize, req, DetokenizeReply, self.timeout,
                                       wait_for_responders_s=self.wait_s, idempotent=True,
                                       paused_wait_s=self.paused_s)
        self.calls, self.last_ns = self.calls + 1, time.time_ns()
        self.first_ns, self.busy_ns = self.first_ns or started, self.busy_ns + self.last_ns - started
        self.window = self.window[reply.prefix_offset:]
        self.read_offset = reply.read_offset - reply.prefix_offset
        self.held = reply.held
        self.matched = reply.stop_reason
        return reply.text, reply.stopped


@dataclass
class ChoiceState:
    index: int
    detok: Detok
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id it ended at (eos: None)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def feed(self, chunk: TokenChunk) -> str:
        """Take a chunk; returns the new text. Sets `finish_reason` when the choice ends."""
        if self.finished:
            return ""
        self.num_tokens += len(chunk.token_ids)
        self.num_prompt_tokens = chunk.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = chunk.num_cached_tokens or self.num_cached_tokens
        if chunk.logprobs:
            self.logprobs += chunk.logprobs
        if chunk.text is not None:  # the worker's engine already detokenized (and applied stop strings)
            delta, stopped = chunk.text, False
        else:
            delta, stopped = await self.detok.push(chunk.token_ids, chunk.finished)
        self.text += delta
        if stopped:
            self.finish_reason, self.stop_reason = "stop", self.detok.matched
        elif chunk.finished:
            self.finish_reason, self.stop_reason = chunk.finish_reason or "stop", chunk.stop_reason
        return delta
