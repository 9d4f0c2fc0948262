"""Planner knobs: the SLO, the scaling policy per pool, and which actuator carries decisions out.

Every field is a flag of `moebus serve planner` (nested models as JSON, e.g.
`--policy '{"ttft_target_s": 1, "pools": {"both": {"min_replicas": 1, "max_replicas": 8}}}'`).
docs/planner.md explains each knob.
"""
from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moebus.shared.messages.planner import PoolName
from moebus.shared.service import ServiceConfig


class PoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1)  # no scale to zero: demand is read from workers
    max_replicas: int = Field(4, ge=1)
    # Prior of the learned capacity: work tokens/s one replica sustains within the SLO (work: prompt
    # tokens x prefill_token_weight + output tokens; prefill pool: prompt tokens; decode: output).
    capacity_tokens_s: float = Field(200.0, gt=0)
    target_inflight: float = Field(8.0, gt=0)  # requests (running + waiting) per replica at 100 % load

    @model_validator(mode="after")
    def _bounds(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttft_target_s: float = Field(2.0, gt=0)  # SLO: worst worker's recent p90 time to first token
    itl_target_s: float = Field(0.2, gt=0)  # SLO: worst worker's recent p90 inter-token latency
    max_waiting_per_replica: float = Field(2.0, ge=0)  # a longer queue counts as an SLO violation
    kv_high: float = Field(0.95, gt=0, le=1)  # KV usage above this counts as an SLO violation
    upper_utilisation: float = Field(0.8, gt=0, le=1)  # scale out above this predicted load per replica
    lower_utilisation: float = Field(0.5, ge=0, le=1)  # scale in when the load fits one replica fewer below this
    scale_out_cooldown_s: float = Field(30.0, ge=0)  # since the last scale-out
    scale_in_cooldown_s: float = Field(60.0, ge=0)  # since the last action of either kind
    scale_in_stable_s: float = Field(30.0, ge=0)  # the load must fit below the lower bound this long
    startup_grace_s: float = Field(180.0, ge=0)  # replicas asked for but not seen block scale-outs this long
    max_step_out: int = Field(2, ge=1)  # replicas added per decision at most (scale-in: always 1)
    level_alpha: float = Field(0.5, gt=0, le=1)  # forecast smoothing of the level (Holt)
    trend_beta: float = Field(0.2, ge=0, le=1)  # forecast smoothing of the trend
    lookahead_s: float = Field(10.0, ge=0)  # forecast this far ahead (about a replica's start time)
    capacity_alpha: float = Field(0.2, ge=0, le=1)  # learning rate of the per-replica capacity
    capacity_floor: float = Field(0.1, gt=0, le=1)  # the learned capacity never drops below prior x this
    # The workers' latency_window_s: an SLO breach bounds capacity by the most served in that window.
    latency_window_s: float = Field(30.0, gt=0)
    prefill_token_weight: float = Field(0.25, ge=0)  # aggregated pool: cost of a prompt token vs an output token
    pools: dict[PoolName, PoolConfig] = {"both": PoolConfig()}  # the pools to plan; others are ignored

    @model_validator(mode="after")
    def _band(self) -> Self:
        if self.lower_utilisation >= self.upper_utilisation:
            raise ValueError("lower_utilisation must be below upper_utilisation (the hysteresis band)")
        return self


class LocalActuatorConfig(BaseModel):
    """Worker processes on this machine: `python -m moebus.services.worker` with these fields."""

    model_config = ConfigDict(extra="forbid")

    worker: dict[str, Any] = {}  # WorkerConfig fields of every started worker (model, engine, max_queued...)
    log_dir: str | None = None  # one <instance>.log per started worker; None: inherit stderr
    stop_timeout_s: float = Field(30.0, gt=0)  # on planner shutdown: SIGTERM its workers, kill after this


class KubernetesActuatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str | None = None  # None: the pod's own (in cluster), else "default"
    deployments: dict[PoolName, str] = {"both": "worker", "prefill": "worker-prefill", "decode": "worker-decode"}
    in_cluster: bool = True  # service-account credentials; false: ~/.kube/config


class PlannerConfig(ServiceConfig):
    interval_s: float = Field(5.0, gt=0)  # one decision per pool this often
    warmup_s: float = Field(3.0, ge=0)  # watch heartbeats this long before the first decision
    missed_heartbeats: int = Field(3, ge=1)  # a worker silent this many intervals is asked if it is gone
    probe_timeout_s: float = Field(0.5, gt=0)  # no answer by then: paused, kept (shared/liveness.py)
    rate_window_s: float = Field(10.0, gt=0)  # request/token rates over the beats of this window
    actuator: Literal["none", "local", "kubernetes"] = "none"
    policy: PolicyConfig = PolicyConfig()
    local: LocalActuatorConfig = LocalActuatorConfig()
    kubernetes: KubernetesActuatorConfig = KubernetesActuatorConfig()
