"""Balancer routing policies: each one's candidate order ("kv": least loaded when no KV info is
known; "round_robin": rotates one per route; "random": a seeded shuffle), full workers last."""
from __future__ import annotations

import pytest

from moebus.services.balancer import BalancerConfig, BalancerService
from moebus.services.balancer.policy import StaticOrder
from moebus.services.balancer.service import _Route
from moebus.services.balancer.table import WorkerTable
from moebus.shared.messages import GenerateRequest, Heartbeat, Load


def beat(wid: str, waiting: int = 0, max_waiting: int = 8) -> Heartbeat:
    return Heartbeat(service="worker", instance_id=wid, ts=0, interval_s=1.0, ready=True, model="m",
                     load=Load(num_running=0, num_waiting=waiting, max_waiting=max_waiting,
                               kv_blocks_free=100, kv_blocks_total=100))


def balancer(policy: str, waiting: dict[str, int], **kw) -> BalancerService:
    bal = BalancerService(BalancerConfig(policy=policy, **kw))
    bal.table = WorkerTable()
    for wid, n in waiting.items():
        bal.table.observe(beat(wid, n), 0.0)
    return bal


async def routes(bal: BalancerService, n: int) -> list[list[str]]:
    req = GenerateRequest(request_id="r", model="m", prompt_token_ids=[1, 2, 3], reply_to="x.y")
    return [[e.worker_id for e in await bal._ordered(req, _Route(), None)] for _ in range(n)]


async def test_kv_policy_is_least_loaded_without_kv_info() -> None:
    bal = balancer("kv", {"a": 3, "b": 0, "c": 1})
    assert bal.static is None
    assert await routes(bal, 2) == [["b", "c", "a"]] * 2


async def test_round_robin_rotates_one_worker_per_route_ignoring_load() -> None:
    bal = balancer("round_robin", {"c": 0, "a": 5, "b": 0})
    assert await routes(bal, 4) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


async def test_random_is_a_seeded_shuffle_covering_every_worker() -> None:
    waiting = {w: 0 for w in "abcdef"}
    one, two = balancer("random", waiting, policy_seed=7), balancer("random", waiting, policy_seed=7)
    orders = await routes(one, 20)
    assert orders == await routes(two, 20), "same seed, same orders"
    assert all(sorted(o) == list("abcdef") for o in orders)
    assert len({o[0] for o in orders}) > 2, "the first pick varies"


def test_full_workers_go_last_under_static_policies() -> None:
    t = WorkerTable()
    for wid, n in {"a": 8, "b": 0, "c": 0}.items():  # a: queue at max_waiting
        t.observe(beat(wid, n), 0.0)
    for policy in ("round_robin", "random"):
        order = StaticOrder(policy, seed=1)
        for _ in range(3):
            assert order.order(t.candidates("m", 0.0))[-1].worker_id == "a"


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError):
        BalancerConfig(policy="fastest")
    with pytest.raises(ValueError):
        StaticOrder("kv")
