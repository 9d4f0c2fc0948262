from __future__ import annotations

from typing import Literal

from pydantic import Field

from moebus.shared.limits import GenerationLimits
from moebus.shared.service import ServiceConfig


class BalancerConfig(ServiceConfig):
    missed_heartbeats: int = Field(3, ge=1)  # a worker silent this many intervals is dead
    # A worker that missed its beats is asked for its health this long (at least one interval): no
    # responders means it is gone; a timeout, that it is paused (kept, not routed to).
    probe_timeout_s: float = Field(0.5, gt=0)
    worker_timeout_s: float = 5.0  # how long a worker may take to accept (not to finish) a request
    # A route asked again (same request id and attempt: the frontend heard nothing in time) gets the
    # answer already given for this long, instead of a second worker (route_memo.py).
    route_memo_s: float = Field(60.0, ge=0)
    # aggregated: any worker runs a whole request; disaggregated: a prefill worker runs it to its
    # first token, a decode worker (which receives the KV) the rest.
    mode: Literal["aggregated", "disaggregated"] = "aggregated"
    kv_aware: bool = True  # rank workers by the prompt prefix they cache (our index of their KV events)
    # kv: the KV-aware + load ranking (least loaded without KV info); round_robin / random:
    # baselines for comparing routing on the same trace (policy.py)
    policy: Literal["kv", "round_robin", "random"] = "kv"
    policy_seed: int | None = None  # random: a fixed seed for repeatable runs
    # Forget a KV holder's blocks after it has been silent this long (holders send a snapshot at
    # least every worker kv_snapshot_s; the broker's holder_ttl_s likewise).
    kv_holder_ttl_s: float = Field(30.0, gt=0)
    # How long a decode worker waits for its prefill half (a queued prefill may take long; a dead
    # prefill worker fails its halves at once through balancer.worker_lost).
    kv_transfer_timeout_s: float = 300.0
    # What a routed request may ask for (n, max_tokens, the prompt vs the context, stops...), the
    # frontend's bounds checked again: over one, BAD_REQUEST and no worker (shared/limits.py).
    # The frontend's `limits` values (`moebus up` passes them; run alone, give the same).
    limits: GenerationLimits = GenerationLimits()
