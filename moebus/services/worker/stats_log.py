"""The worker's periodic stats line (vLLM's "Avg prompt throughput ..." line): every interval while
it has work or had some since the last line, one INFO line with requests running and waiting, KV
cache usage, and prompt / generation tokens per second over the interval."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from moebus.shared.messages import Load

from .engine_metrics import EngineMetrics, kv_usage

log = logging.getLogger(__name__)


class StatsLine:
    def __init__(self, load: Callable[[], Load], counts: EngineMetrics) -> None:
        self.load, self.counts = load, counts
        self._at = time.monotonic()
        self._prompt, self._generated = counts.prompt_total, counts.generated_total

    def line(self) -> str | None:
        """The line for the interval since the last call; None when idle throughout."""
        now, load = time.monotonic(), self.load()
        dt = max(now - self._at, 1e-9)
        prompt, generated = self.counts.prompt_total - self._prompt, self.counts.generated_total - self._generated
        self._at, self._prompt, self._generated = now, self.counts.prompt_total, self.counts.generated_total
        if not (prompt or generated or load.num_running or load.num_waiting):
            return None
        return (f"running {load.num_running}, waiting {load.num_waiting}, KV cache {100 * kv_usage(load):.1f}% "
                f"used, prompt {prompt / dt:.1f} tok/s, generation {generated / dt:.1f} tok/s")

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if (text := self.line()) is not None:
                log.info("stats: %s", text)
