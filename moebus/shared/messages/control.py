"""Control plane: heartbeats (with load, watched by the balancer), health and lifecycle events."""
from __future__ import annotations

from ..codec import Message


class Load(Message):
    num_running: int = 0
    num_waiting: int = 0  # queued in the engine plus accepted but not yet handed to it
    max_waiting: int = 0  # admission limit; beyond it the worker answers "overloaded"
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    # Workers sharing one host's cores (platforms/cpu/core_share.py): the group they share ("" for
    # none), and the requests (running + queued) one of them should hold before the balancer wakes
    # an idle worker of the group instead (0: spread as usual; balancer/packing.py).
    core_group: str = ""
    pack_rows: int = 0
    # Demand, for the planner: cumulative counts since the process started (rates come from
    # differences between beats), and latency over the last `window_s` seconds (None: no sample).
    requests_total: int = 0  # requests accepted
    prompt_tokens_total: int = 0  # prompt tokens of accepted requests
    output_tokens_total: int = 0  # tokens generated
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache (as moebus:prefix_cache_queries)
    prefix_cache_hits_total: int = 0  # of them, found cached (hit rate = hits / queries)
    ttft_p50_s: float | None = None  # accept -> first token (queueing included)
    ttft_p90_s: float | None = None
    itl_p50_s: float | None = None  # gaps between a request's successive chunks
    itl_p90_s: float | None = None
    window_s: float = 0.0

    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0..1); 0 before the engine reports its blocks."""
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens found cached / looked up since the process started; None before any prompt."""
        q = self.prefix_cache_queries_total
        return self.prefix_cache_hits_total / q if q else None


class KVInfo(Message):
    """What a balancer needs to hash prompts the way this worker's KV cache names blocks."""

    namespace: str
    block_size: int
    transfer_address: str | None = None  # decode side: where prefill workers push KV payloads


class Heartbeat(Message):
    service: str
    instance_id: str
    ts: float
    interval_s: float
    ready: bool = True
    draining: bool = False  # going away: route nothing new here
    model: str | None = None
    load: Load | None = None
    role: str | None = None  # workers: "both" | "prefill" | "decode"
    kv: KVInfo | None = None  # workers with a real KV cache
    # Random per process: the same instance id with a new incarnation is a restart, and whatever the
    # old process held is lost (a supervisor can restart it within the missed-heartbeat window).
    incarnation: str = ""
    restarts: int = 0  # times a supervisor (`moebus up`) restarted this instance id after it crashed
    bus_node: str | None = None  # the NATS node it is connected to ("host:port"): shared/cluster_view.py


class HealthReply(Message):
    service: str
    instance_id: str
    status: str = "ok"  # "ok" | "draining"
    ready: bool = False
    uptime_s: float = 0.0


class WorkerLost(Message):
    worker_id: str
    reason: str = "missed heartbeats"
