"""KV-aware routing (the balancer's policy): requests follow the cache until load outweighs it."""
from __future__ import annotations

import pytest

from moebus.services.balancer.kv_routing import (
    RoutingWeights,
    WorkerState,
    choose_worker,
    overlaps,
    prefill_tokens,
    rank_workers,
    routing_cost,
)
from moebus.shared.messages import PrefixMatch

W = RoutingWeights(block_size=16)


def test_prefill_tokens_keeps_the_last_token():
    assert prefill_tokens(100, 0) == 100
    assert prefill_tokens(100, 64) == 36
    assert prefill_tokens(96, 96) == 1  # a full hit still computes the last token


def test_routing_follows_the_cache_at_equal_load():
    workers = [WorkerState("a"), WorkerState("b", cached_blocks=30), WorkerState("c", cached_blocks=10)]
    assert [w for w, _ in rank_workers(512, workers, W)] == ["b", "c", "a"]
    assert routing_cost(512, workers[1], W) == 512 - 30 * 16


def test_load_outweighs_a_small_overlap_but_not_a_big_one():
    busy_small = WorkerState("cached", cached_blocks=2, num_waiting=3)
    idle = WorkerState("idle")
    assert choose_worker(512, [busy_small, idle], W) == "idle"  # 32 tokens saved < 3 queued requests
    busy_big = WorkerState("cached", cached_blocks=120, num_waiting=3)
    assert choose_worker(2048, [busy_big, idle], W) == "cached"  # 1920 tokens saved > the queue
    exact = WorkerState("cached", cached_blocks=120, queued_prefill_tokens=4000)
    assert choose_worker(2048, [exact, idle], W) == "idle"  # exact queued work, when reported


def test_shared_tier_helps_everyone_but_local_cache_wins():
    a, b = WorkerState("a"), WorkerState("b", cached_blocks=20)
    # The broker holds 20 blocks: both can use them; b's are already on device (no load cost).
    assert routing_cost(400, a, W, shared_tier_blocks=20) == pytest.approx(80 + 320 * W.tier_load_cost)
    assert choose_worker(400, [a, b], W, shared_tier_blocks=20) == "b"
    # With only the tier, the idle worker that loads wins over a busy one that recomputes.
    busy = WorkerState("busy", num_running=8)
    assert choose_worker(400, [busy, a], W, shared_tier_blocks=20) == "a"


def test_full_and_roomless_workers():
    full = WorkerState("full", cached_blocks=30, num_waiting=4, max_waiting=4)
    cramped = WorkerState("cramped", cached_blocks=5, kv_blocks_free=2)
    roomy = WorkerState("roomy", kv_blocks_free=1000)
    assert [w for w, _ in rank_workers(512, [full, cramped, roomy], W)] == ["roomy", "cramped"]
    assert choose_worker(512, [full], W) is None
    assert [w for w, _ in rank_workers(64, [WorkerState("y"), WorkerState("x")], W)] == ["x", "y"]  # tie: name


def test_overlaps_from_broker_matches():
    matches = [PrefixMatch(holder="w1", tier="device", num_blocks=7), PrefixMatch(holder="kvbroker", tier="cpu",
               num_blocks=5), PrefixMatch(holder="w2", tier="cpu", num_blocks=3),
               PrefixMatch(holder="w2", tier="device", num_blocks=1)]
    device, tiers, shared = overlaps(matches)
    assert device == {"w1": 7, "w2": 1} and tiers == {"w2": 3} and shared == 5
    workers = [WorkerState(w, cached_blocks=device.get(w, 0), tier_blocks=tiers.get(w, 0)) for w in ("w1", "w2", "w3")]
    assert [w for w, _ in rank_workers(160, workers, W, shared)] == ["w1", "w2", "w3"]


def test_index_side_imports_stay_torch_free():
    import subprocess
    import sys

    mods = ["moebus.services.kvbroker", "moebus.services.balancer.kv_routing", "moebus.services.balancer.kv_rank",
            "moebus.kv.broker_client", "moebus.kv.index", "moebus.kv.hashing", "moebus.kv.host", "moebus.kv.connector_port",
            "moebus.kv.transports.credit", "moebus.services.kvbroker.config", "moebus.shared.messages.kvbroker"]
    code = f"import sys\nfor m in {mods!r}: __import__(m)\nassert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
