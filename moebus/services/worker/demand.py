"""What the worker tells the planner in each heartbeat (Load): cumulative demand counts, and TTFT
and inter-token-latency percentiles over a sliding window of recent samples."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@dataclass(slots=True)
class LatencyWindow:
    """Samples of the last `window_s` seconds (at most `max_samples`, the newest kept)."""

    window_s: float = 30.0
    max_samples: int = 4096
    _samples: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, value: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, value))
        if len(self._samples) > self.max_samples:
            self._samples.popleft()

    def percentiles(self, now: float | None = None) -> tuple[float, float] | None:
        """(p50, p90) of the window; None without samples."""
        cutoff = (time.monotonic() if now is None else now) - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        if not self._samples:
            return None
        values = sorted(v for _, v in self._samples)
        return _percentile(values, 0.5), _percentile(values, 0.9)


@dataclass(slots=True)
class Demand:
    window_s: float = 30.0
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: LatencyWindow = field(init=False)
    itl: LatencyWindow = field(init=False)

    def __post_init__(self) -> None:
        self.ttft, self.itl = LatencyWindow(self.window_s), LatencyWindow(self.window_s)

    def accepted(self, prompt_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens

    def generated(self, tokens: int) -> None:
        self.output_tokens += tokens

    def fields(self) -> dict[str, float | int | None]:
        """Load's demand fields."""
        ttft, itl = self.ttft.percentiles(), self.itl.percentiles()
        return {"requests_total": self.requests, "prompt_tokens_total": self.prompt_tokens,
                "output_tokens_total": self.output_tokens, "window_s": self.window_s,
                "ttft_p50_s": ttft[0] if ttft else None, "ttft_p90_s": ttft[1] if ttft else None,
                "itl_p50_s": itl[0] if itl else None, "itl_p90_s": itl[1] if itl else None}
