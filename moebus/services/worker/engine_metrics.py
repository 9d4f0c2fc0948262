"""The worker's vLLM-shaped metrics (`moebus:*`, named as vLLM's `vllm:*` where the meaning
matches), labelled model_name and engine (this worker's instance id). Queue depth and KV usage
are read at scrape time (the engine's stats come through EngineLoop.stats); token and request
counts are fed per chunk. Client-side latencies (TTFT, ITL, e2e) are the frontend's."""
from __future__ import annotations

from collections.abc import Callable

from moebus.shared.messages import Load, TokenChunk
from moebus.shared.metrics import Metrics


def kv_usage(load: Load) -> float:
    """Fraction of KV blocks in use (0..1); 0 before the engine reports its blocks."""
    return load.kv_usage()


class EngineMetrics:
    def __init__(self, metrics: Metrics, model: str, engine: str, load: Callable[[], Load]) -> None:
        labels = ("model_name", "engine")
        values = (model, engine)

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            metrics.gauge(name, doc, labels).labels(*values).set_function(read)

        # Each scrape reads the load once per gauge; load() is cheap (dict reads).
        gauge("moebus:num_requests_running", "Requests in the engine's running batch",
              lambda: load().num_running)
        gauge("moebus:num_requests_waiting", "Requests accepted that have not produced a token",
              lambda: load().num_waiting)
        gauge("moebus:kv_cache_usage_perc", "KV cache usage (1 = full)", lambda: kv_usage(load()))
        self._hits = metrics.counter("moebus:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                     labels).labels(*values)
        self._queries = metrics.counter("moebus:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                        "cache", labels).labels(*values)
        self._prompt = metrics.counter("moebus:prompt_tokens", "Prompt tokens of requests prefilled here", labels).labels(*values)
        self._generated = metrics.counter("moebus:generation_tokens", "Tokens generated", labels).labels(*values)
        self._success = metrics.counter("moebus:request_success", "Requests finished, by finish reason",
                                        (*labels, "finished_reason"))
        self._values = values
        self.prompt_total = self.generated_total = 0  # plain counts for the stats line (stats_log.py)
        self.queries_total = self.hits_total = 0  # prefix cache tokens, for the heartbeat's Load

    def first_chunk(self, chunk: TokenChunk, *, prefilled_here: bool) -> None:
        """A request's first chunk: its prompt was prefilled (unless elsewhere: a decode half or a resume)."""
        if prefilled_here and chunk.num_prompt_tokens:
            self._queries.inc(chunk.num_prompt_tokens)
            self._hits.inc(chunk.num_cached_tokens)
            self._prompt.inc(chunk.num_prompt_tokens)  # all of them, cached or not, as vLLM counts
            self.prompt_total += chunk.num_prompt_tokens
            self.queries_total += chunk.num_prompt_tokens
            self.hits_total += chunk.num_cached_tokens

    def chunk(self, chunk: TokenChunk) -> None:
        self._generated.inc(len(chunk.token_ids))
        self.generated_total += len(chunk.token_ids)

    def finished(self, reason: str | None) -> None:
        self._success.labels(*self._values, reason or "stop").inc()
