"""Latencies as clients see them, in vLLM's shape (`moebus:time_to_first_token_seconds`,
`moebus:inter_token_latency_seconds`, `moebus:e2e_request_latency_seconds`, labelled model_name).

A Clock starts when a generation is asked for (before routing) and ends when it closes. The
choices of that generation (TimedChoice) tell it when tokens came: the first one observes TTFT,
each later chunk the time since the previous one per token (ITL)."""
from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from moebus.shared.messages import TokenChunk
from moebus.shared.metrics import Metrics

from .choice import ChoiceState

# TTFT and e2e span queueing and long generations; ITL is milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0)


class Latencies:
    def __init__(self, metrics: Metrics) -> None:
        labels = ["model_name"]
        self.ttft = metrics.histogram("moebus:time_to_first_token_seconds", "Generation asked for to first "
                                      "token, as the frontend sees it", labels, TTFT_BUCKETS)
        self.itl = metrics.histogram("moebus:inter_token_latency_seconds", "Time between tokens of a choice, "
                                     "as the frontend sees them", labels, ITL_BUCKETS)
        self.e2e = metrics.histogram("moebus:e2e_request_latency_seconds", "Generation asked for to closed",
                                     labels, E2E_BUCKETS)
        # The clock of the generation this task entered last: its choices are made right after.
        self.current: ContextVar[Clock | None] = ContextVar(f"clock-{id(self)}", default=None)

    def start(self, model: str) -> Clock:
        clock = Clock(self, model)
        self.current.set(clock)
        return clock


@dataclass(slots=True)
class Clock:
    latencies: Latencies
    model: str
    started: float = field(default_factory=time.monotonic)
    first_at: float | None = None
    choices: list[ChoiceState] = field(default_factory=list)  # of this generation (TimedChoice's)

    def tokens(self, n: int, last_at: float | None) -> float:
        """n tokens came for a choice whose previous chunk came at last_at; returns now."""
        now = time.monotonic()
        if n:
            if self.first_at is None:
                self.first_at = now
                self.latencies.ttft.labels(self.model).observe(now - self.started)
            elif last_at is not None:
                self.latencies.itl.labels(self.model).observe((now - last_at) / n)
        return now

    @property
    def n_tokens(self) -> int:
        """Completion tokens of every choice so far (as usage counts them)."""
        return sum(c.num_tokens for c in self.choices)

    def close(self) -> None:
        self.latencies.e2e.labels(self.model).observe(time.monotonic() - self.started)


@dataclass
class TimedChoice(ChoiceState):
    """A choice that tells its generation's clock when its tokens come."""

    clock: Clock | None = None
    last_at: float | None = None

    def __post_init__(self) -> None:
        if self.clock is not None:
            self.clock.choices.append(self)

    async def feed(self, chunk: TokenChunk) -> str:
        if self.clock is not None and not self.finished and chunk.token_ids:
            self.last_at = self.clock.tokens(len(chunk.token_ids), self.last_at)
        return await ChoiceState.feed(self, chunk)
