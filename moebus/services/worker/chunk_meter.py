"""What a worker measures of each chunk it sends, in one place: its own TTFT histogram and token
counter, the vLLM-shaped engine metrics (engine_metrics.py) and the planner's demand window
(demand.py). The worker's output path says what went out; this decides what each of them counts.
"""
from __future__ import annotations

from moebus.shared.messages import TokenChunk
from moebus.shared.metrics import Metrics

from .demand import Demand
from .engine_metrics import EngineMetrics


class ChunkMeter:
    def __init__(self, metrics: Metrics, engine: EngineMetrics, demand: Demand) -> None:
        self.engine, self.demand = engine, demand
        self._ttft = metrics.histogram("time_to_first_token_seconds", "Accept to first token")
        self._tokens = metrics.counter("generated_tokens_total", "Tokens generated")

    def sent(self, chunk: TokenChunk, *, first: bool, since_s: float, prefilled_here: bool, now: float) -> None:
        """A chunk went out: its request's first (since_s: since it was accepted) or a later one
        (since_s: since the one before). prefilled_here: its prompt ran on this worker (not a
        decode half or a resumed request), so its TTFT and prompt tokens are this worker's."""
        n = len(chunk.token_ids)
        if first:
            self._ttft.observe(since_s)
            self.engine.first_chunk(chunk, prefilled_here=prefilled_here)
            if prefilled_here:
                self.demand.ttft.add(since_s, now)
        elif n:
            self.demand.itl.add(since_s / n, now)
        self._tokens.inc(n)
        self.engine.chunk(chunk)
        self.demand.generated(n)

    def finished(self, reason: str | None) -> None:
        self.engine.finished(reason)
