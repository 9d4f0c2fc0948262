"""KV identity: a block is served only under the key, and for the model, it was stored for.

A block's checksum covers its block hash and KV fingerprint (payload.KVBlock), so a disk file
swapped with or renamed to another block's, a block replayed under another key, a payload listing
its blocks under other hashes, or blocks of another model or cache layout are dropped and counted
like a flipped bit, never served; a request over them recomputes and gives the cold run's tokens.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moebus.kv import encoding
from moebus.kv.hashing import kv_fingerprint, kv_namespace, stable_block_hashes
from moebus.kv.payload import KVBlock, KVIdentityError, KVPayload
from moebus.kv.tiers.cpu import CpuTier
from moebus.kv.tiers.disk import DiskTier
from moebus.kv.tiers.store import TieredKVStore
from moebus.kv.transfer import inject_prefilled, prefill
from moebus.services.worker.kv_engine import EngineKV

from .conftest import BLOCK, GREEDY, run
from .test_kv_integrity import _offload, _warm
from .test_kv_integrity_broker import broker_and_worker, corrupt_count
from .test_kv_tiers import block, same
from .test_kv_transport import make_payload

FP_A, FP_B = kv_fingerprint("model-a|float32|4|(2, 8)"), kv_fingerprint("model-b|float32|4|(2, 8)")


def key_file(directory: Path, h: int) -> Path:
    return directory / f"{h:016x}.kvb"


def swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap.tmp-x")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def made(h: int, fp: int = FP_A) -> KVBlock:
    """block(h) as an engine makes it: under its hash and its engine's fingerprint."""
    return KVBlock(block(h).layers, block_hash=h, fingerprint=fp)


# --- tiers ---------------------------------------------------------------------------------------
def test_disk_tier_serves_no_swapped_file(tmp_path):
    # The reproduction: 10 stored blocks of one size, files swapped pairwise.
    hits: list[str] = []
    tier = DiskTier(tmp_path, 10 << 20, on_corrupt=hits.append)
    for h in range(10):
        tier.put(h, block(h))  # an anonymous block takes the key it is stored under
    for h in range(0, 10, 2):
        swap(key_file(tmp_path, h), key_file(tmp_path, h + 1))
    assert [tier.get(h) for h in range(10)] == [None] * 10
    assert tier.corrupt == 10 and hits == ["disk"] * 10 and len(tier) == 0 and not list(tmp_path.iterdir())


def test_disk_tier_drops_a_file_renamed_or_copied_to_another_key(tmp_path):
    tier = DiskTier(tmp_path, 10 << 20)
    for h in (1, 2):
        tier.put(h, made(h))
    key_file(tmp_path, 1).rename(key_file(tmp_path, 7))  # to a key never stored
    shutil.copy(key_file(tmp_path, 2), key_file(tmp_path, 8))
    again = DiskTier(tmp_path, 10 << 20)  # the index comes from the file names
    assert sorted(again.keys()) == [2, 7, 8]
    assert again.get(7) is None and again.get(8) is None and again.corrupt == 2
    got = again.get(2)
    assert same(got, block(2)) and (got.block_hash, got.fingerprint) == (2, FP_A) and got.intact()
    assert [p.name for p in tmp_path.iterdir()] == [key_file(tmp_path, 2).name]


def test_disk_tier_drops_files_of_the_previous_format(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(encoding, "VERSION", encoding.VERSION - 1)  # written by a build without block identities
        DiskTier(tmp_path, 10 << 20).put(3, block(3))
    tier = DiskTier(tmp_path, 10 << 20)
    assert 3 in tier and tier.get(3) is None and tier.corrupt == 1 and not list(tmp_path.iterdir())


def test_cpu_tier_and_store_never_serve_a_block_under_another_key(tmp_path):
    hits: list[str] = []
    cpu = CpuTier(10 << 20, hits.append)
    cpu.put(1, block(1))
    assert cpu.get(1).block_hash == 1
    cpu.put(2, cpu.get(1))  # block 1 replayed under key 2
    cpu.put(3, made(4))
    assert cpu.get(2) is None and cpu.get(3) is None and cpu.corrupt == 2 and hits == ["cpu", "cpu"]
    assert 2 not in cpu and 3 not in cpu and same(cpu.get(1), block(1))
    with pytest.raises(KVIdentityError):
        made(4).check_identity(3)

    # A fast tier's wrong block is dropped; the slower tier's own copy is served (and promoted).
    store = TieredKVStore([cpu, DiskTier(tmp_path, 10 << 20)], write_through=True)
    store.put(5, made(5))
    cpu.discard(5)
    cpu.put(5, made(6))
    got = store.get(5)
    assert same(got, block(5)) and got.block_hash == 5 and cpu.corrupt == 3 and store.where(5) == "cpu"


def test_a_block_of_another_model_or_layout_is_dropped_by_a_reader_that_names_its_own(tmp_path):
    for tier in (CpuTier(10 << 20), DiskTier(tmp_path, 10 << 20)):
        for h in (1, 2):
            tier.put(h, made(h, FP_A))
        assert tier.get(1) is not None and tier.get(1, FP_A) is not None  # 0: any model (the broker)
        assert tier.get(2, FP_B) is None and tier.corrupt == 1 and 2 not in tier
    assert DiskTier(tmp_path, 10 << 20).get(1, FP_B) is None  # the fingerprint survives the file


# --- payloads ------------------------------------------------------------------------------------
def test_a_payload_listing_its_blocks_under_other_hashes_keeps_only_those_before():
    p = make_payload()  # 5 blocks, 4 of them full (hashed)
    h = p.block_hashes

    def relisted(hashes: list[int], namespace: str = p.namespace) -> KVPayload:
        """p's blocks and checksums, named otherwise in the header (the sender's bug)."""
        return KVPayload(p.layers, p.block_size, p.num_tokens, p.token_ids, hashes, namespace, p.request_id,
                         p.first_token, p.generator_state, list(p.block_checksums))

    q = relisted([h[0], h[2], h[1], h[3]])
    assert not q.block(1).intact() and q.block(0).intact()
    got = KVPayload.from_bytes(q.to_bytes())
    assert got.corrupt_blocks == 2 and got.num_blocks == 1 and got.block_hashes == h[:1]
    assert got.num_tokens == 16 and got.block(0).intact() and got.block(0).block_hash == h[0]
    other = KVPayload.from_bytes(relisted(h, "another model").to_bytes())  # another fingerprint
    assert other.corrupt_blocks == 5 and other.num_blocks == 0
    assert KVPayload.from_bytes(p.to_bytes()).equal(p)


def test_tier_blocks_regrouped_under_other_hashes_or_models_fail_their_check():
    blocks = [made(10), made(11), made(12)]
    q = KVPayload.from_blocks([blocks[0], blocks[2], blocks[1]], [10, 11, 12], 4)  # the broker's bug
    got = KVPayload.from_bytes(q.to_bytes())
    assert got.num_blocks == 1 and got.corrupt_blocks == 2 and same(got.block(0), blocks[0])
    mixed = KVPayload.from_blocks([blocks[0], made(11, FP_B)], [10, 11], 4)
    assert mixed.fingerprint == FP_A and not mixed.block(1).intact()
    assert KVPayload.from_bytes(mixed.to_bytes()).num_blocks == 1
    anon = KVPayload.from_blocks([block(10), block(11)], [10, 11], 4, namespace="model-a")
    assert [anon.block(i).block_hash for i in range(2)] == [10, 11] and anon.block(1).intact()


# --- the broker's tiers and a worker's fetch -----------------------------------------------------
async def test_broker_serves_blocks_only_under_their_own_key_and_model(nats_server, tmp_path):
    dropped: list[int] = []
    async with broker_and_worker(nats_server.url, tmp_path, dropped) as (svc, w, _):
        assert await w.put_blocks(list(range(6)), [made(i) for i in range(6)])
        cpu, disk = svc.store.tiers
        assert sorted(disk.keys()) == [0, 1, 2] and sorted(cpu.keys()) == [3, 4, 5]

        cpu._blocks[4] = cpu._blocks[3]  # block 3 replayed under key 4 in host memory
        got = await w.get_blocks([3, 4, 5])
        assert len(got) == 1 and same(got[0], block(3)) and corrupt_count(svc, "cpu") == 1 and 4 not in cpu

        swap(key_file(tmp_path, 0), key_file(tmp_path, 1))  # disk files swapped
        assert await w.get_blocks([0, 1, 2]) == [] and corrupt_count(svc, "disk") == 1
        assert await w.get_blocks([1, 2]) == [] and corrupt_count(svc, "disk") == 2
        got = await w.get_blocks([2])
        assert len(got) == 1 and same(got[0], block(2)) and got[0].block_hash == 2

        # A put that lists its blocks under each other's hashes: none of them is stored.
        assert await w.put(KVPayload.from_blocks([made(10), made(11)], [11, 10], 4))
        assert 10 not in svc.store and 11 not in svc.store and corrupt_count(svc, "transfer") == 2

        # Another model's worker asks for these hashes: the blocks arrive and are dropped.
        assert await w.get_blocks([5], fingerprint=FP_B) == [] and dropped == [1]
        assert len(await w.get_blocks([5], fingerprint=FP_A)) == 1 and dropped == [1]


# --- a real engine: the request still gives the cold run's tokens --------------------------------
def test_swapped_disk_files_are_recomputed_with_the_same_output(engine_b, prompt, reference, tmp_path):
    disk = DiskTier(tmp_path, 64 << 20)
    store = TieredKVStore([disk])
    hashes = _offload(engine_b, "swap-cold", prompt, store)
    swap(key_file(tmp_path, hashes[1]), key_file(tmp_path, hashes[2]))
    n, tokens, computed = _warm(engine_b, "swap-warm", prompt, store)
    assert n == BLOCK and tokens == reference and disk.corrupt == 1  # block 0 only; 1.. recomputed
    assert computed == len(prompt) - BLOCK + GREEDY.max_tokens - 1 and hashes[1] not in disk


def test_tier_blocks_of_another_model_are_recomputed_with_the_same_output(engine_b, prompt, reference):
    cpu = CpuTier(64 << 20)
    store = TieredKVStore([cpu])
    hashes = _offload(engine_b, "model-cold", prompt, store)
    assert cpu.get(hashes[0]).fingerprint == kv_fingerprint(kv_namespace(engine_b))
    other = kv_fingerprint(kv_namespace(engine_b) + "|another checkpoint")
    b = cpu.get(hashes[1])
    cpu.discard(hashes[1])
    cpu.put(hashes[1], KVBlock(b.layers, block_hash=hashes[1], fingerprint=other))
    n, tokens, computed = _warm(engine_b, "model-warm", prompt, store)
    assert n == BLOCK and tokens == reference and cpu.corrupt == 1 and hashes[1] not in cpu
    assert computed == len(prompt) - BLOCK + GREEDY.max_tokens - 1


def test_transfers_of_other_hashes_or_models_are_recomputed_with_the_same_output(engine_a, engine_b, prompt,
                                                                                  reference):
    engine_b.block_manager.reset_prefix_cache()
    pre = prefill(engine_a, "p-id", prompt, GREEDY)
    p = pre.payload
    h = p.block_hashes

    def resent(hashes: list[int], namespace: str = "", fingerprint: int = 0, crcs: bool = True) -> KVPayload:
        q = KVPayload(p.layers, p.block_size, p.num_tokens, p.token_ids, hashes, namespace, p.request_id,
                      p.first_token, p.generator_state, list(p.block_checksums) if crcs else [],
                      fingerprint=fingerprint or p.fingerprint)
        return KVPayload.from_bytes(q.to_bytes())

    # Blocks 1 and 2 listed under each other's hashes: only block 0 is adopted.
    got = resent([h[0], h[2], h[1]])
    assert got.corrupt_blocks == 2 and got.num_tokens == BLOCK
    res = inject_prefilled(engine_b, "d-swap", prompt, pre.first_token, GREEDY, got)
    assert res.injected and res.num_tokens == BLOCK
    out = run(engine_b, "d-swap")
    assert [pre.first_token] + out.tokens == reference
    engine_b.block_manager.reset_prefix_cache()

    # Whole and self-consistent, but not this prompt's blocks here (e.g. hashed for another image),
    # or made by another model: refused, counted as corrupt, recomputed.
    kv = EngineKV(on_corrupt=(seen := []).append)
    other_hashes = stable_block_hashes(prompt[: len(h) * BLOCK], BLOCK, kv_namespace(engine_b) + "|image")
    for rid, bad in (("d-hash", resent(other_hashes, crcs=False)),
                     ("d-model", resent(h, fingerprint=kv_fingerprint("another model"), crcs=False))):
        assert bad.corrupt_blocks == 0
        kv.inject(engine_b, rid, prompt, pre.first_token, GREEDY, bad)
        out = run(engine_b, rid)
        assert [pre.first_token] + out.tokens == reference
        assert out.computed == len(prompt) + GREEDY.max_tokens - 1  # prompt + first token recomputed
        engine_b.block_manager.reset_prefix_cache()
    assert kv.counters["kv_inject_corrupt_blocks"] == 2 * p.num_blocks and seen == ["transfer"] * 2 * p.num_blocks
    assert kv.counters["kv_inject_refused"] == 2 and kv.counters["kv_injected"] == 0
