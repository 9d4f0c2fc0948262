"""The scaling algorithm, pure (no I/O, time passed in): observations of each pool -> replica counts.

Per pool and tick:
1. load, in replica-equivalents = max(work tokens/s / learned capacity per replica, requests in
   flight / target_inflight), each forecast `lookahead_s` ahead by Holt smoothing;
2. SLO check: worst recent p90 TTFT (prefill and aggregated pools) and ITL (decode and aggregated)
   against the targets, queue per replica, KV usage;
3. scale out when the SLO is violated or the predicted load exceeds upper_utilisation x replicas
   (to ceil(load / upper), at most max_step_out more), unless in the scale-out cool-down or still
   waiting for replicas it asked for (startup_grace_s);
4. scale in by one when the load (the larger of now and predicted) would fit on one replica fewer
   below lower_utilisation, without an SLO violation, for scale_in_stable_s, and the last action is
   scale_in_cooldown_s old; min/max replicas bound everything.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from moebus.shared.messages.planner import PoolDecision, PoolName, PoolObservation, ScaleAction

from .capacity import Capacity
from .config import PolicyConfig, PoolConfig
from .forecast import Holt

TTFT_POOLS, ITL_POOLS = ("both", "prefill"), ("both", "decode")


@dataclass(slots=True)
class PoolState:
    desired: int
    work: Holt  # work tokens/s of the pool
    inflight: Holt  # requests running + waiting in the pool
    capacity: Capacity
    last_out: float = -math.inf
    last_action: float = -math.inf
    fits_since: float | None = None  # since when the load fits one replica fewer (None: it does not)


@dataclass(slots=True)
class Outcome:
    action: ScaleAction
    desired: int
    reason: str


@dataclass(slots=True)
class ScalingPolicy:
    cfg: PolicyConfig
    pools: dict[PoolName, PoolState] = field(default_factory=dict)

    def decide(self, observed: Mapping[PoolName, PoolObservation], now: float) -> list[PoolDecision]:
        """One decision per configured pool (a pool nobody reports is observed as empty)."""
        return [self._decide(pool, pcfg, observed.get(pool, PoolObservation()), now)
                for pool, pcfg in self.cfg.pools.items()]

    def work_rate(self, pool: PoolName, obs: PoolObservation) -> float:
        if pool == "prefill":
            return obs.prompt_tokens_rate
        if pool == "decode":
            return obs.output_tokens_rate
        return obs.prompt_tokens_rate * self.cfg.prefill_token_weight + obs.output_tokens_rate

    def violation(self, pool: PoolName, obs: PoolObservation) -> str | None:
        """Why the pool misses its SLO now, or None."""
        c = self.cfg
        if obs.replicas == 0:
            return None
        if pool in TTFT_POOLS and obs.ttft_p90_s is not None and obs.ttft_p90_s > c.ttft_target_s:
            return f"ttft p90 {obs.ttft_p90_s:.3g}s > {c.ttft_target_s:g}s"
        if pool in ITL_POOLS and obs.itl_p90_s is not None and obs.itl_p90_s > c.itl_target_s:
            return f"itl p90 {obs.itl_p90_s:.3g}s > {c.itl_target_s:g}s"
        if obs.num_waiting > c.max_waiting_per_replica * obs.replicas:
            return f"{obs.num_waiting} waiting > {c.max_waiting_per_replica:g} per replica"
        if obs.kv_usage is not None and obs.kv_usage > c.kv_high:
            return f"kv usage {obs.kv_usage:.2f} > {c.kv_high:g}"
        return None

    def _state(self, pool: PoolName, pcfg: PoolConfig, obs: PoolObservation) -> PoolState:
        st = self.pools.get(pool)
        if st is None:  # start from what runs or boots: only min/max resize a fleet the planner finds
            c = self.cfg
            st = self.pools[pool] = PoolState(
                desired=obs.replicas + obs.starting,
                work=Holt(c.level_alpha, c.trend_beta), inflight=Holt(c.level_alpha, c.trend_beta),
                capacity=Capacity(pcfg.capacity_tokens_s, c.capacity_alpha, c.capacity_floor,
                                  c.latency_window_s))
        return st

    def _decide(self, pool: PoolName, pcfg: PoolConfig, obs: PoolObservation, now: float) -> PoolDecision:
        c, st = self.cfg, self._state(pool, pcfg, obs)
        previous, slo = st.desired, self.violation(pool, obs)
        work = self.work_rate(pool, obs)
        if obs.replicas:
            st.capacity.observe(work / obs.replicas, slo is not None, now)
        st.work.update(work, now)
        st.inflight.update(obs.num_running + obs.num_waiting, now)
        cap = st.capacity.value
        predicted = max(st.work.predict(c.lookahead_s) / cap, st.inflight.predict(c.lookahead_s) / pcfg.target_inflight)
        level = max(st.work.predict(0) / cap, st.inflight.predict(0) / pcfg.target_inflight)
        out = self._next(st, pcfg, obs, predicted, max(level, predicted), slo, now)
        st.desired = out.desired
        return PoolDecision(pool=pool, action=out.action, desired=out.desired, previous=previous, reason=out.reason,
                            predicted_load=predicted, utilisation=predicted / max(previous, 1),
                            capacity_tokens_s=cap, slo_violated=slo is not None, observed=obs)

    def _next(self, st: PoolState, pcfg: PoolConfig, obs: PoolObservation, predicted: float, load_in: float,
              slo: str | None, now: float) -> Outcome:
        c, n = self.cfg, st.desired
        if n < pcfg.min_replicas:
            return self._out(st, pcfg.min_replicas, now, "below min_replicas")
        if n > pcfg.max_replicas:
            st.last_action = now
            return Outcome("scale_in", pcfg.max_replicas, "above max_replicas")
        hot = slo or (f"predicted load {predicted:.2f} > {c.upper_utilisation:g} x {n}"
                      if predicted > c.upper_utilisation * n else None)
        if hot:
            st.fits_since = None
            pending = n - obs.replicas
            if n >= pcfg.max_replicas:
                return Outcome("hold", n, f"{hot}; at max_replicas")
            if now - st.last_out < c.scale_out_cooldown_s:
                return Outcome("hold", n, f"{hot}; scale-out cool-down")
            if pending > 0 and now - st.last_out < c.startup_grace_s:
                return Outcome("hold", n, f"{hot}; waiting for {pending} replica(s) to start")
            target = max(n + 1, math.ceil(predicted / c.upper_utilisation))
            return self._out(st, min(target, n + c.max_step_out, pcfg.max_replicas), now, hot)
        if n <= pcfg.min_replicas or load_in > c.lower_utilisation * (n - 1):
            st.fits_since = None
            return Outcome("hold", n, "within bounds")
        if st.fits_since is None:
            st.fits_since = now
        fits = f"load {load_in:.2f} fits {n - 1} replica(s) below {c.lower_utilisation:g}"
        if now - st.fits_since < c.scale_in_stable_s:
            return Outcome("hold", n, f"{fits} for {now - st.fits_since:.0f}s of {c.scale_in_stable_s:g}s")
        if now - st.last_action < c.scale_in_cooldown_s:
            return Outcome("hold", n, f"{fits}; scale-in cool-down")
        st.last_action = st.fits_since = now  # a further step needs another stable period
        return Outcome("scale_in", n - 1, fits)

    @staticmethod
    def _out(st: PoolState, desired: int, now: float, reason: str) -> Outcome:
        st.last_out = st.last_action = now
        return Outcome("scale_out", desired, reason)
