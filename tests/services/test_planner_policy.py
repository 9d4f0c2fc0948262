"""The planner's algorithm without I/O: scaling under a ramp, no flapping on noise, cool-downs,
scale-in after the load ends, min/max, per-pool decisions; the forecast, capacity and fleet view."""
from __future__ import annotations

import random

import pytest

from moebus.services.planner.capacity import Capacity
from moebus.services.planner.config import PolicyConfig, PoolConfig
from moebus.services.planner.fleet import Fleet
from moebus.services.planner.forecast import Holt
from moebus.services.planner.policy import ScalingPolicy
from moebus.shared.messages import Heartbeat, Load
from moebus.shared.messages.planner import PoolObservation

TICK = 5.0


def policy(**kw) -> ScalingPolicy:
    pools = kw.pop("pools", {"both": PoolConfig(min_replicas=1, max_replicas=8, target_inflight=4)})
    base = {"scale_out_cooldown_s": 20, "scale_in_cooldown_s": 40, "scale_in_stable_s": 30, "lookahead_s": 10}
    return ScalingPolicy(PolicyConfig(pools=pools, **{**base, **kw}))


def run(p: ScalingPolicy, inflight: list[float], replicas: int = 1, t0: float = 0.0):
    """Feed one observation per tick; replicas come up at once. Returns (time, decision) per tick."""
    out, n = [], replicas
    for k, x in enumerate(inflight):
        t = t0 + k * TICK
        d = p.decide({"both": PoolObservation(replicas=n, num_running=round(x))}, t)[0]
        out.append((t, d))
        n = d.desired
    return out


def actions(trace) -> list[tuple[float, str, int]]:
    return [(t, d.action, d.desired) for t, d in trace if d.action != "hold"]


def test_scales_out_under_a_ramp_and_never_in_while_it_rises() -> None:
    trace = run(policy(), [1.2 * k for k in range(21)] + [24] * 10)  # 0 -> 24 in flight over 100 s
    desired = [d.desired for _, d in trace]
    assert desired == sorted(desired), "no scale-in during the ramp"
    assert desired[-1] >= 24 / (0.8 * 4), "enough replicas for the peak under the upper bound"
    assert all(a == "scale_out" for _, a, _ in actions(trace))


def test_no_flapping_with_noise_around_the_threshold() -> None:
    rng = random.Random(7)
    load = [0.8 * 4 * 2 + rng.uniform(-1.5, 1.5) for _ in range(200)]  # ~the upper bound of 2 replicas
    acts = actions(run(policy(), load, replicas=2))
    assert len(acts) <= 1 and all(a == "scale_out" for _, a, _ in acts), acts


def test_cool_downs_are_respected() -> None:
    p = policy(max_step_out=1)
    trace = run(p, [40] * 30 + [0] * 60)
    outs = [t for t, a, _ in actions(trace) if a == "scale_out"]
    ins = [t for t, a, _ in actions(trace) if a == "scale_in"]
    assert len(outs) >= 3 and all(b - a >= 20 for a, b in zip(outs, outs[1:], strict=False))
    assert ins and all(b - a >= 40 for a, b in zip(ins, ins[1:], strict=False))
    assert ins[0] - 30 * TICK >= 30, "scale-in only after the load fit for scale_in_stable_s"


def test_scales_back_in_one_at_a_time_after_the_load_ends() -> None:
    trace = run(policy(), [30] * 20 + [0] * 120)
    peak = max(d.desired for _, d in trace)
    assert peak >= 6 and trace[-1][1].desired == 1
    steps = [(d.previous, d.desired) for _, d in trace if d.action == "scale_in"]
    assert all(a - b == 1 for a, b in steps) and len(steps) == peak - 1


def test_min_and_max_bound_every_decision() -> None:
    p = policy(pools={"both": PoolConfig(min_replicas=2, max_replicas=3, target_inflight=4)})
    trace = run(p, [500] * 20 + [0] * 100, replicas=1)
    assert trace[0][1].action == "scale_out" and trace[0][1].desired == 2 and "min" in trace[0][1].reason
    assert max(d.desired for _, d in trace) == 3 and min(d.desired for _, d in trace) == 2
    assert trace[-1][1].desired == 2
    over = policy(pools={"both": PoolConfig(min_replicas=1, max_replicas=2)})
    d = over.decide({"both": PoolObservation(replicas=5)}, 0)[0]  # starts from what runs, then bounds it
    assert (d.action, d.previous, d.desired, d.reason) == ("scale_in", 5, 2, "above max_replicas")


def test_slo_violation_scales_out_even_at_low_load_and_waits_for_booting_replicas() -> None:
    p = policy(scale_out_cooldown_s=0)
    d = p.decide({"both": PoolObservation(replicas=1, num_running=1, ttft_p90_s=5.0)}, 0)[0]
    assert (d.action, d.desired, d.slo_violated) == ("scale_out", 2, True) and "ttft" in d.reason
    # the second replica is not up yet: no third while it boots, even with the SLO still missed
    d = p.decide({"both": PoolObservation(replicas=1, num_running=1, ttft_p90_s=5.0)}, 5)[0]
    assert d.action == "hold" and "waiting" in d.reason
    d = p.decide({"both": PoolObservation(replicas=2, num_running=1, itl_p90_s=1.0)}, 10)[0]
    assert (d.action, d.desired) == ("scale_out", 3)
    d = p.decide({"both": PoolObservation(replicas=3, num_waiting=10)}, 15)[0]
    assert d.action == "scale_out" and "waiting" in d.reason


def test_disaggregated_pools_are_decided_separately() -> None:
    pools = {"prefill": PoolConfig(max_replicas=4, capacity_tokens_s=1000, target_inflight=100),
             "decode": PoolConfig(max_replicas=4, capacity_tokens_s=100, target_inflight=100)}
    p = policy(pools=pools, scale_out_cooldown_s=0)
    obs = {"prefill": PoolObservation(replicas=1, prompt_tokens_rate=3000.0, output_tokens_rate=0),
           "decode": PoolObservation(replicas=1, output_tokens_rate=50.0, ttft_p90_s=9.0)}
    d = {x.pool: x for x in p.decide(obs, 0)}
    assert d["prefill"].action == "scale_out" and d["prefill"].desired == 3  # 3000 tok/s / 1000: +2 (max step)
    assert d["decode"].action == "hold"  # a TTFT miss is the prefill pool's, and 50 of 100 tok/s is fine
    obs = {"prefill": PoolObservation(replicas=3, prompt_tokens_rate=1500.0),
           "decode": PoolObservation(replicas=1, output_tokens_rate=50.0, itl_p90_s=0.5)}
    d = {x.pool: x for x in p.decide(obs, 5)}
    assert d["decode"].action == "scale_out" and "itl" in d["decode"].reason
    assert d["prefill"].action == "hold"


def test_capacity_learns_from_throughput_at_observed_latency() -> None:
    c = Capacity(prior=100, alpha=0.5, floor=0.1, window_s=30)
    c.observe(40, slo_violated=True, now=0)  # broke the SLO at 40: capacity is at most 40
    assert c.value == pytest.approx(70)
    c.observe(200, slo_violated=False, now=100)  # met it at 200: at least 200
    assert c.value == pytest.approx(135)
    c.observe(50, slo_violated=False, now=200)  # a quiet tick teaches nothing
    assert c.value == pytest.approx(135)
    for k in range(50):
        c.observe(1, slo_violated=True, now=300 + 60 * k)
    assert c.value == pytest.approx(10)  # the floor


def test_a_breach_bounds_capacity_by_the_most_served_in_the_latency_window() -> None:
    """Load falls while the workers' 30 s latency window still holds the peak's breach: the
    falling throughput is no upper bound, the peak is (the estimate must not ratchet down)."""
    c = Capacity(prior=100, alpha=0.5, floor=0.01, window_s=30)
    c.observe(60, slo_violated=True, now=0)  # the peak broke the SLO: at most 60
    assert c.value == pytest.approx(80)
    for t, x in ((5, 40), (10, 20), (15, 10), (20, 5)):  # the ramp down, breach still reported
        c.observe(x, slo_violated=True, now=t)
    assert c.value >= 60
    c.observe(5, slo_violated=True, now=40)  # the peak has left the window: a real breach at 5
    assert c.value < 60


def test_holt_forecast_follows_a_linear_trend() -> None:
    h = Holt(alpha=0.5, beta=0.3)
    for k in range(40):
        h.update(2.0 * k, k * 1.0)
    assert h.predict(0) == pytest.approx(78, abs=1) and h.predict(10) == pytest.approx(98, abs=2)
    for k in range(40, 43):
        h.update(0, k)
    assert h.trend < 0 and h.predict(10) == 0.0  # a falling trend never predicts below zero


def test_policy_config_rejects_an_empty_band() -> None:
    with pytest.raises(ValueError):
        PolicyConfig(lower_utilisation=0.8, upper_utilisation=0.8)
    with pytest.raises(ValueError):
        PoolConfig(min_replicas=3, max_replicas=2)


def beat(wid: str, ts: float, role: str = "both", draining: bool = False, **load) -> Heartbeat:
    return Heartbeat(service="worker", instance_id=wid, ts=ts, interval_s=1.0, role=role, draining=draining,
                     load=Load(**load))


def test_fleet_rates_restarts_and_expiry() -> None:
    f = Fleet(missed_heartbeats=3, rate_window_s=10)
    for k in range(6):
        f.observe(beat("w-0", 100 + k, requests_total=2 * k, prompt_tokens_total=100 * k,
                       output_tokens_total=10 * k, num_running=3, kv_blocks_free=25, kv_blocks_total=100,
                       ttft_p90_s=0.5), k)
    f.observe(beat("w-1", 100, draining=True, num_waiting=2, ttft_p90_s=0.9), 5)
    f.observe(beat("p-0", 100, role="prefill"), 5)
    o = f.observations()
    assert set(o) == {"both", "prefill"}
    b = o["both"]
    assert (b.replicas, b.draining, b.num_running, b.num_waiting) == (1, 1, 3, 2)
    assert (b.request_rate, b.prompt_tokens_rate, b.output_tokens_rate) == (2, 100, 10)
    assert b.kv_usage == pytest.approx(0.75) and b.ttft_p90_s == 0.9
    f.observe(beat("w-0", 106, requests_total=0), 6)  # restarted: its counters went down
    assert f.observations()["both"].request_rate == 0
    assert sorted(f.expire(8.5)) == ["p-0", "w-1"] and [w.worker_id for w in f.workers()] == ["w-0"]
