"""Published by the planner: what it saw of each worker pool and the replica count it decided."""
from __future__ import annotations

from typing import Literal

from ..codec import Message

PoolName = Literal["both", "prefill", "decode"]  # a worker pool is named by its workers' role
ScaleAction = Literal["scale_out", "scale_in", "hold"]


class PoolObservation(Message):
    """One pool as the planner saw it in one tick (rates from the workers' cumulative counters)."""

    replicas: int = 0  # ready and not draining
    starting: int = 0  # heartbeating, not ready yet (loading the model)
    draining: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float | None = None  # mean fraction of KV blocks in use; None: no worker reports a cache
    request_rate: float = 0.0  # requests/s accepted
    prompt_tokens_rate: float = 0.0  # prompt tokens/s accepted
    output_tokens_rate: float = 0.0  # tokens/s generated
    ttft_p90_s: float | None = None  # worst worker's recent p90 (None: no sample)
    itl_p90_s: float | None = None


class PoolDecision(Message):
    pool: PoolName
    action: ScaleAction
    desired: int  # the replica count the actuator is asked for
    previous: int  # the count asked for before this tick
    reason: str = ""
    predicted_load: float = 0.0  # replica-equivalents expected `lookahead_s` from now
    utilisation: float = 0.0  # predicted_load / previous
    capacity_tokens_s: float = 0.0  # learned work tokens/s one replica sustains within the SLO
    slo_violated: bool = False
    observed: PoolObservation = PoolObservation()


class PlannerDecision(Message):
    planner_id: str
    ts: float
    ttft_target_s: float
    itl_target_s: float
    actuator: str
    pools: list[PoolDecision] = []
