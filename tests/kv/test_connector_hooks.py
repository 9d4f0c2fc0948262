"""The KV connector as the scheduler and the engine's step call it (vLLM's connector shape): once
a worker attaches it with a tier, nobody else calls load or offload. Blocks computed are offloaded
and reported by the step itself; a waiting request's prefix is loaded from the tier by the
scheduler at admission (also after a preemption); a tier that fails costs only the hit."""
from __future__ import annotations

import pytest

from moebus.engine.llm_engine import LLMEngine
from moebus.kv.tiers.cpu import CpuTier
from moebus.kv.tiers.store import TieredKVStore

from .conftest import BLOCK, GREEDY, make_engine, run


@pytest.fixture(scope="module")
def attached() -> tuple[LLMEngine, TieredKVStore]:
    engine = make_engine()
    store = TieredKVStore([CpuTier(64 << 20)])
    engine.kv.attach(store)
    return engine, store


def test_the_step_offloads_and_the_scheduler_loads(attached, long_prompt):
    engine, store = attached
    bm, n_full = engine.block_manager, len(long_prompt) // BLOCK
    first = run(engine, "cold", long_prompt)  # no before/after hooks: the engine calls the connector
    offloaded = engine.kv.take_offloaded()
    stored, evicted = engine.kv.take_events()
    assert len(offloaded) >= n_full and set(offloaded) <= set(store.tiers[0].keys())
    assert set(offloaded[:n_full]) <= set(stored) and not evicted
    assert engine.kv.take_offloaded() == [] and engine.kv.take_events() == ([], [])  # taken once

    bm.reset_prefix_cache()  # the device cache lost it (eviction, an engine rebuilt)
    assert set(engine.kv.take_events()[1]) >= set(offloaded[:n_full])
    hits = store.tiers[0].hits
    again = run(engine, "warm", long_prompt)
    assert again.tokens == first.tokens
    assert again.computed == first.computed - n_full * BLOCK  # its prefix came from the tier
    assert store.tiers[0].hits - hits == n_full
    bm.reset_prefix_cache()


def test_a_preempted_request_finds_its_blocks_in_the_tier_again(attached, long_prompt):
    engine, store = attached
    bm, n_full = engine.block_manager, len(long_prompt) // BLOCK
    reference = run(engine, "ref", long_prompt).tokens
    engine.kv.take_offloaded()
    bm.reset_prefix_cache()
    engine.add_request("pre", long_prompt, GREEDY)
    first = [t for o in engine.step() for t in o.new_token_ids]  # admitted: prefix loaded, the rest computed
    req = engine.get_request("pre")
    assert req.num_cached_tokens == n_full * BLOCK
    engine.scheduler.preempt_all()  # back to waiting, nothing computed (e.g. blocks ran out)
    bm.reset_prefix_cache()  # ... and the device cache let its blocks go
    hits = store.tiers[0].hits
    assert first + run(engine, "pre").tokens == reference
    assert store.tiers[0].hits - hits == n_full  # admitted again: loaded again
    bm.reset_prefix_cache()


def test_a_failing_tier_costs_the_hit_not_the_request(attached, long_prompt):
    engine, store = attached
    bm = engine.block_manager
    reference = run(engine, "ok", long_prompt).tokens
    bm.reset_prefix_cache()
    free = bm.num_free_blocks

    def broken(*_a, **_k):
        raise OSError("tier unreadable")

    original, store.get_prefix = store.get_prefix, broken
    try:
        again = run(engine, "broken", long_prompt)
    finally:
        store.get_prefix = original
    assert again.tokens == reference and again.computed >= len(long_prompt)  # computed, not loaded
    assert bm.num_free_blocks == free  # nothing leaked by the failed load
    bm.reset_prefix_cache()
