from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, model_validator

from moebus.shared.limits import GenerationLimits
from moebus.shared.service import ServiceConfig


class WorkerConfig(ServiceConfig):
    model: str = "smollm2"  # engine model name or checkpoint dir; "toy" runs the torch-free stand-in
    served_model_name: str | None = None  # the name clients use; default: `model`
    max_queued: int = Field(128, ge=1)  # requests waiting for their first token; beyond: "overloaded"
    # What a request may ask for, the frontend's bounds checked again: over one, BAD_REQUEST, never
    # run (shared/limits.py). max_model_len: as the engine's.
    limits: GenerationLimits = GenerationLimits()
    latency_window_s: float = 30.0  # TTFT / ITL percentiles in the heartbeat cover this many seconds
    drain_grace_s: float = 30.0  # on SIGTERM, how long running requests may take to finish
    # A broken engine is rebuilt in this process this many times (backoff restart_backoff_s x the
    # restart count) before the process exits for its supervisor to restart.
    engine_restarts: int = Field(3, ge=0)
    engine_restart_backoff_s: float = Field(1.0, ge=0)
    engine: dict[str, Any] = {}  # extra EngineConfig (or ToyEngineConfig) fields, e.g. {"max_num_seqs": 8}
    # Prefill/decode split: what the balancer routes here (any worker still runs whole requests).
    role: Literal["both", "prefill", "decode"] = "both"
    kv_transport: Literal["nats", "shm"] = "nats"  # how KV reaches this decode worker (shm: same host)
    # NATS KV moves on a connection of its own; the bytes in flight to this worker, all transfers
    # together (credit, kv/transports/credit.py), far below nats-server's 64 MiB MaxPending.
    kv_credit_bytes: int = Field(16 * 1024 * 1024, ge=1024 * 1024)
    # A prefill worker names the split requests it holds to their decode workers every
    # handoff_beat_s; a decode half whose prefill half goes unnamed for handoff_lost_s is given up
    # as the prefill worker's fault (retryable: the frontend moves the request on).
    handoff_beat_s: float = Field(1.0, gt=0)
    handoff_lost_s: float = Field(6.0, gt=0)
    # KV broker: publish prefix-cache events (KV-aware routing); a local CPU tier; sharing its
    # blocks through the broker's tiers (needs kv_cpu_bytes > 0).
    kv_events: bool = True
    kv_cpu_bytes: int = Field(0, ge=0)
    kv_share: bool = False
    kv_snapshot_s: float = Field(10.0, gt=0)  # full index snapshot this often (< the broker's holder_ttl_s)
    # kv_share: what the broker's tiers hold, as its KV events tell (it snapshots them every
    # snapshot_s), is forgotten after this long without one; then no fetch asks it (kv_link.py).
    kv_broker_ttl_s: float = Field(30.0, gt=0)
    torch_threads: int | None = None  # torch intra-op threads of this process (None: torch's default)
    # Workers on one host sharing its torch_threads cores (platforms/cpu/core_share.py): the directory of their
    # busy files; before each step a worker takes torch_threads // (workers with work). None: off.
    core_share_dir: str | None = None
    # With core_share_dir: the requests (running + queued) this worker holds before the balancer
    # wakes an idle worker sharing its cores (balancer/packing.py). Below it a shared-core step is
    # memory-bound: two bf16 SmolLM2 workers at c=16 gave 504 tok/s where one gave 627 (Zen 4, 2
    # cores; BENCHMARKS.md, "bf16 throughput at c=16 and c=64"); at c=64 two gave 945 where one 882.
    pack_rows: int = Field(32, ge=0)
    ep: int = Field(1, ge=1)  # expert-parallel group size: this many ranks, one WorkerService each
    # Chunks already sent, kept for a frontend that lost some in a bus blip (replay.py): all
    # requests' together (0: none kept), and how long after a request ends.
    replay_max_bytes: int = Field(64 * 1024 * 1024, ge=0)
    # (past the frontend's bus_outage_s: streams that ended while the bus was away, e.g. a nats-server
    # paused a minute, are still here when it returns; the byte bound caps the memory)
    replay_grace_s: float = Field(150.0, ge=0)
    # A frontend unheard for this long (while we could hear) or restarted has its requests aborted
    # here (leases.py): a dead frontend's streams have no reader. 0: never.
    frontend_lease_s: float = Field(10.0, ge=0)
    # Before it reports ready, the worker runs one short generation on each new engine: C kernels
    # compile and every step path runs once, so the first user request is not the one that waits.
    warmup: bool = True
    warmup_timeout_s: float = Field(600.0, gt=0)  # a first C kernel build can take minutes
    # Added to the engine thread's nice value (and so its torch compute threads'): the event loop,
    # the bus and the other services on the host then run before the next step's compute when they
    # wake, so a token goes out while that step runs (it helped c=1 TTFT on 2 cores, but not under
    # heavy outside load: docs/benchmarks/history-stack.md). It also yields to unrelated processes: 0 (off)
    # unless the host only serves.
    engine_nice: int = Field(0, ge=0, le=19)
    # After a step that made a request's first token, the engine thread waits up to this long
    # (ms) for the event loop to put the token on the bus before it starts the next step, which
    # would hold the cores the loop needs (engine_loop.py); 0: never wait.
    first_token_handoff_ms: float = Field(3.0, ge=0, le=100)
    # Then, when first tokens are at least half of that step's outputs (c=1: always; a full batch's
    # other requests would pay for it), it starts no step until this long (ms) after that one ended:
    # nats-server, the frontend and the client carry the token out while the cores are free.
    # 0: no hold.
    first_token_hold_ms: float = Field(6.0, ge=0, le=100)
    # A request admitted while the engine thread sleeps (idle): the event loop waits up to this long
    # (ms) for the thread to wake with it, the GIL released, so its step starts before the loop has
    # finished the accept reply (engine_loop.py); 0: never wait.
    admit_handoff_ms: float = Field(2.0, ge=0, le=100)
    # A stats line (running, waiting, KV usage, tok/s) this often while there is work; 0: none.
    stats_log_interval_s: float = Field(10.0, ge=0)

    @model_validator(mode="after")
    def _context_of_engine(self) -> Self:
        """limits.max_model_len unset: the engine's, when `engine` names it."""
        if "max_model_len" in self.engine and "max_model_len" not in self.limits.model_fields_set:
            self.limits = self.limits.model_copy(update={"max_model_len": int(self.engine["max_model_len"])})
        return self
