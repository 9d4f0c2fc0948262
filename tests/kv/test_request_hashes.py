"""A request's stable block hashes are computed once: the frontend's ride into the engine request and
every KV consumer of the engine (cache events, offload, transfer) reads them from there."""
from __future__ import annotations

from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams
from moebus.kv.cache_events import CacheEventTracker
from moebus.kv.hashing import BlockHashes, hash_space, kv_namespace, stable_block_hashes
from moebus.kv.tiers.cpu import CpuTier
from moebus.kv.tiers.offload import KVOffloader
from moebus.kv.tiers.store import TieredKVStore
from moebus.kv.transfer import extract_kv

from .conftest import BLOCK


def _drive(engine: LLMEngine, rid: str, prompt: list[int],
           hashes: BlockHashes | None) -> tuple[list[int], list[int], list[int]]:
    """After one request's prefill: the stable hashes its cache events report, those it offloads,
    and those its KV payload carries."""
    engine.block_manager.reset_prefix_cache()
    tracker, offloader = CacheEventTracker(), KVOffloader(TieredKVStore([CpuTier(64 << 20)]))
    engine.add_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0), block_hashes=hashes)
    engine.step()
    stored = tracker.poll(engine)[0]
    offloaded = offloader.offload(engine)
    payload = extract_kv(engine, rid)
    while engine.has_unfinished_requests():
        engine.step()
    return stored, offloaded, payload.block_hashes


def test_the_carried_hashes_are_the_ones_every_consumer_uses(engine_a: LLMEngine, prompt: list[int]) -> None:
    ns, n = kv_namespace(engine_a), len(prompt) // BLOCK
    true = stable_block_hashes(prompt, BLOCK, ns)
    assert len(true) == n >= 3
    plain = _drive(engine_a, "unseeded", prompt, None)
    assert all(got[:n] == true for got in plain)
    # Deliberately not the prompt's hashes (never do this outside a test): the consumers name the
    # blocks by them, which shows nothing hashed the prompt again.
    marked = [h ^ 1 for h in true]
    seeded = _drive(engine_a, "seeded", prompt, BlockHashes(hash_space(ns, BLOCK), marked))
    assert all(got[:n] == marked for got in seeded)
    # Hashes of another space are not used.
    other = _drive(engine_a, "other-space", prompt, BlockHashes(hash_space(ns, BLOCK * 2), marked))
    assert all(got[:n] == true for got in other)
