"""CPU/disk tiers, the tiered store, and prefix loading into a real engine."""
from __future__ import annotations

import os
import time

import torch

from moebus.kv.cache_events import CacheEventTracker
from moebus.kv.payload import KVBlock
from moebus.kv.tiers.cpu import CpuTier
from moebus.kv.tiers.disk import DiskTier
from moebus.kv.tiers.load import load_prefix
from moebus.kv.tiers.offload import KVOffloader
from moebus.kv.tiers.store import TieredKVStore

from .conftest import run


def block(seed: int, dim: int = 8) -> KVBlock:
    g = torch.Generator().manual_seed(seed)
    return KVBlock([(torch.randn(4, 2, dim, generator=g), torch.randn(4, 2, dim, generator=g).to(torch.bfloat16))
                    for _ in range(3)])


def same(a: KVBlock, b: KVBlock) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for p, q in zip(a.layers, b.layers, strict=True) for x, y in zip(p, q, strict=True))


def test_cpu_tier_is_lru_by_bytes():
    size = block(0).nbytes
    tier = CpuTier(3 * size)
    for h in range(3):
        assert tier.put(h, block(h)) == []
    assert tier.get(0) is not None  # 0 is now the most recent
    evicted = tier.put(3, block(3))
    assert [h for h, _ in evicted] == [1] and same(evicted[0][1], block(1))
    assert sorted(tier.keys()) == [0, 2, 3] and tier.nbytes == 3 * size
    assert tier.put(9, KVBlock([(torch.zeros(1000, 100), torch.zeros(1))])) != []  # larger than the tier


def test_disk_tier_survives_reopen_and_keeps_lru(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=10 << 20)
    for h in (5, 6, 7):
        tier.put(h, block(h))
    (tmp_path / ".0000000000000009.kvb.dead.tmp").write_bytes(b"torn write")  # a crash mid-write
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp") and "dead" not in p]
    os.utime(tmp_path / f"{5:016x}.kvb", (1, 1))  # 5 is the oldest
    again = DiskTier(tmp_path, capacity_bytes=10 << 20)
    assert sorted(again.keys()) == [5, 6, 7] and again.nbytes == tier.nbytes
    assert not list(tmp_path.glob("*.tmp"))
    assert same(again.get(6), block(6)) and again.get(8) is None
    small = DiskTier(tmp_path, capacity_bytes=2 * again.nbytes // 3 + 1)  # limit shrank: oldest goes
    assert sorted(small.keys()) == [6, 7] and not (tmp_path / f"{5:016x}.kvb").exists()


def test_store_spills_promotes_and_reports_evictions(tmp_path):
    gone: list[int] = []
    size = block(0).nbytes
    store = TieredKVStore([CpuTier(2 * size), DiskTier(tmp_path, 3 * block(0).packed().nbytes)],
                          on_evict=gone.extend)
    for h in range(4):
        store.put(h, block(h))
    assert store.where(0) == "disk" and store.where(3) == "cpu" and gone == []
    assert store.longest_prefix([0, 1, 2, 3, 99, 4]) == 4
    assert same(store.get(0), block(0)) and store.where(0) == "cpu"  # promoted
    for h in range(4, 7):
        store.put(h, block(h))
    assert gone and all(h not in store for h in gone)
    assert [len(t) for t in store.tiers] == [2, 3]
    assert store.get_prefix([5, 6, 12345, 4]) and len(store.get_prefix([5, 6, 12345])) == 2


def test_offload_then_load_prefix_hits_with_same_output(engine_b, long_prompt, tmp_path):
    bm = engine_b.block_manager
    bm.reset_prefix_cache()
    store = TieredKVStore([CpuTier(64 << 20), DiskTier(tmp_path / "disk", 256 << 20)], write_through=True)
    offloader, tracker = KVOffloader(store), CacheEventTracker()
    events: list[tuple[list[int], list[int]]] = []
    first = run(engine_b, "cold", long_prompt, after_step=lambda: (offloader.offload(engine_b),
                                                                  events.append(tracker.poll(engine_b))))
    n_full = len(long_prompt) // 16
    assert len(store.tiers[0]) >= n_full and len(store.tiers[1]) == len(store.tiers[0])
    stored = [h for s, _ in events for h in s]
    assert len(stored) >= n_full and len(set(stored)) == len(stored)

    bm.reset_prefix_cache()  # the device cache lost it all (eviction, restart)
    assert tracker.poll(engine_b)[1]  # ... which the tracker reports as evicted
    loaded: list[int] = []

    def timed_load() -> None:
        t0 = time.perf_counter()
        loaded.append(load_prefix(engine_b, "warm", store))
        loaded.append(time.perf_counter() - t0)

    again = run(engine_b, "warm", long_prompt, before_step=timed_load)
    assert loaded[0] == n_full * 16 and again.tokens == first.tokens
    assert again.computed == first.computed - n_full * 16
    print(f"\nTTFT {len(long_prompt)}-token prompt: cold {first.ttft_s * 1e3:.0f} ms, loaded from CPU tier "
          f"{again.ttft_s * 1e3:.0f} ms (of which load_prefix {loaded[1] * 1e3:.0f} ms for {n_full} blocks)")

    bm.reset_prefix_cache()  # a restarted worker: only the disk survives
    reopened = TieredKVStore([DiskTier(tmp_path / "disk", 256 << 20)])
    again = run(engine_b, "disk", long_prompt, before_step=lambda: loaded.append(load_prefix(engine_b, "disk", reopened)))
    assert loaded[-1] == n_full * 16 and again.tokens == first.tokens
    print(f"TTFT loaded from a reopened disk tier {again.ttft_s * 1e3:.0f} ms")

    # A local hit is extended, not replaced: only the blocks beyond it come from the store.
    half = long_prompt[:160]  # 10 full blocks; its 6 outputs do not fill an 11th
    bm.reset_prefix_cache()
    run(engine_b, "half", half)
    before = store.tiers[0].hits
    assert load_prefix(engine_b, _add(engine_b, "ext", long_prompt), store) == n_full * 16
    assert store.tiers[0].hits - before == n_full - len(half) // 16
    assert run(engine_b, "ext").tokens == first.tokens
    bm.reset_prefix_cache()


def _add(engine, rid, prompt):
    from .conftest import GREEDY

    engine.add_request(rid, prompt, GREEDY)
    return rid
