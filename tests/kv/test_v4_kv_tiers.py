"""DeepSeek-V4 blocks through the KV tiers: offload a request's blocks (k, v and the compressor /
indexer planes) to the CPU tier and to the disk tier, evict them from the device, restore them
from the tier: the output equals the cold run's. A corrupt plane on disk is caught and recomputed.

Every engine test runs bounded (the default: windowed parts in their own pool; a prefix is restored
only as far as its window tail is there) and unbounded (one pool)."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from moebus.engine.llm_engine import LLMEngine
from moebus.kv.tiers.cpu import CpuTier
from moebus.kv.tiers.disk import DiskTier
from moebus.kv.tiers.load import load_prefix
from moebus.kv.tiers.offload import KVOffloader
from moebus.kv.tiers.store import TieredKVStore

from .conftest import Run, run
from .v4_fixtures import BLOCK, GREEDY32, plane_layout, v4_engine, v4_prompts, write_v4

N = 140  # 8 full prompt blocks restorable (the last token always runs), past 4 HCA windows


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_v4(tmp_path_factory.mktemp("v4tier"))


@pytest.fixture(scope="module", params=[True, False], ids=["bounded", "unbounded"])
def engine(ckpt, request):
    eng = v4_engine(ckpt, bound_sliding_window=request.param)
    assert eng.kv_layout.grouped == request.param
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return v4_prompts(2, (N,))[0]


def _offloaded_cold_run(engine: LLMEngine, prompt: list[int], store: TieredKVStore, rid: str) -> list[int]:
    """A cold run whose full blocks go to the store after every step; its greedy tokens."""
    engine.block_manager.reset_prefix_cache()
    offloader = KVOffloader(store)
    out = run(engine, rid, prompt, GREEDY32, after_step=lambda: offloader.offload(engine)).tokens
    engine.block_manager.reset_prefix_cache()  # evicted from the device: only the tier has them
    assert len(out) == 32
    return out


def _restored_run(engine: LLMEngine, prompt: list[int], store: TieredKVStore, rid: str) -> tuple[Run, int]:
    loaded: list[int] = []
    load: Callable[[], None] = lambda: loaded.append(load_prefix(engine, rid, store))  # noqa: E731
    out = run(engine, rid, prompt, GREEDY32, before_step=load)
    engine.block_manager.reset_prefix_cache()
    return out, loaded[0]


def test_v4_cpu_tier_restore_matches_cold(engine, prompt):
    store = TieredKVStore([CpuTier(64 << 20)])
    cold = _offloaded_cold_run(engine, prompt, store, "cpu-cold")
    cpu = store.tiers[0]
    assert len(cpu) == (N + 31) // BLOCK  # prompt and decoded tokens' full blocks
    block = cpu.get(cpu.keys()[0])
    assert [len(layer) for layer in block.layers] == plane_layout(engine) == [2, 6, 4, 6]
    assert block.intact() and block.nbytes == sum(t[0].numel() * t.element_size()
                                                  for layer in engine.kv_caches for t in layer)
    out, loaded = _restored_run(engine, prompt, store, "cpu-warm")
    assert loaded == (N - 1) // BLOCK * BLOCK
    assert out.tokens == cold
    assert out.computed == N - loaded + GREEDY32.max_tokens - 1  # only the rest of the prompt ran


def test_v4_disk_tier_restore_matches_cold_and_a_corrupt_block_is_recomputed(engine, prompt, tmp_path):
    store = TieredKVStore([DiskTier(tmp_path, 64 << 20)])
    disk = store.tiers[0]
    cold = _offloaded_cold_run(engine, prompt, store, "disk-cold")
    files = sorted(tmp_path.glob("*.kvb"))
    assert len(files) == len(disk) == (N + 31) // BLOCK
    out, loaded = _restored_run(engine, prompt, store, "disk-warm")
    assert loaded == (N - 1) // BLOCK * BLOCK and out.tokens == cold
    assert out.computed == N - loaded + GREEDY32.max_tokens - 1

    # Flip one bit in the last tensor of block 5's file: the last CSA layer's indexer keys.
    from moebus.kv.hashing import kv_namespace, stable_block_hashes

    h5 = stable_block_hashes(prompt[: 6 * BLOCK], BLOCK, kv_namespace(engine))[5]
    path = tmp_path / f"{h5:016x}.kvb"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x08
    path.write_bytes(data)
    out, loaded = _restored_run(engine, prompt, store, "disk-corrupt")
    assert disk.corrupt == 1 and not path.exists()  # detected and dropped, never served
    assert loaded == 5 * BLOCK  # the prefix ends at the hole
    assert out.tokens == cold
    assert out.computed == N - 5 * BLOCK + GREEDY32.max_tokens - 1  # block 5 onward recomputed


def test_v4_restore_needs_the_window_tail(engine, prompt):
    """Tier blocks offloaded after the window had passed them hold their full parts only. A prefix is
    restored only with its window tail (horizon 32: 8 blocks need blocks 6, 7; 7 need 5, 6; 6 need
    4, 5; 5 need 3, 4): without the window parts of blocks 5 and 7, 5 blocks are restored and the rest
    is replayed; an engine that keeps whole windows stops at block 5 too. Either way: the cold run."""
    from moebus.kv.hashing import kv_namespace, stable_block_hashes
    from moebus.kv.payload import KVBlock, missing_part

    store = TieredKVStore([CpuTier(64 << 20)])
    cold = _offloaded_cold_run(engine, prompt, store, "tail-cold")
    cpu = store.tiers[0]
    horizons = [spec.horizons() for spec in engine.model.kv_cache_specs()]
    groups = [tuple(int(h is not None) for h in hs) for hs in horizons]
    hashes = stable_block_hashes(prompt[: 8 * BLOCK], BLOCK, kv_namespace(engine))
    assert all(cpu.get(h).has_window(groups) for h in hashes)  # offloaded every step: windows held
    for i in (5, 7):
        full = cpu.get(hashes[i])
        cpu.discard(hashes[i])
        cpu.put(hashes[i], KVBlock([tuple(missing_part(t) if g else t for t, g in zip(kv, gs, strict=True))
                                    for kv, gs in zip(full.layers, groups, strict=True)]))
        assert not cpu.get(hashes[i]).has_window(groups) and cpu.get(hashes[i]).intact()
    out, loaded = _restored_run(engine, prompt, store, "tail-warm")
    assert loaded == 5 * BLOCK
    assert out.tokens == cold
    assert out.computed == N - 5 * BLOCK + GREEDY32.max_tokens - 1


def test_v4_shaped_blocks_regroup_into_a_payload_and_survive_the_disk(tmp_path):
    """What the broker and the worker's link do with tier blocks (KVPayload.from_blocks, the wire,
    a disk file), on V4-shaped tuples: a sliding layer (k, v), a CSA layer (k, an empty v, src,
    4 entry rows, indexer src, 4 indexer key rows), an HCA layer with 1 entry row a block."""
    import torch

    from moebus.kv.payload import KVBlock, KVPayload

    def v4_block(seed: int) -> KVBlock:
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        return KVBlock([(r(BLOCK, 1, 32), r(BLOCK, 1, 32)),
                        (r(BLOCK, 1, 32), r(BLOCK, 1, 0), r(BLOCK, 128), r(4, 32), r(BLOCK, 64), r(4, 16)),
                        (r(BLOCK, 1, 32), r(BLOCK, 1, 0), r(BLOCK, 64), r(1, 32).to(torch.bfloat16))])

    blocks = [v4_block(i) for i in range(3)]
    payload = KVPayload.from_blocks(blocks, [11, 12, 13], BLOCK)
    again = KVPayload.from_bytes(payload.to_bytes())
    assert again.equal(payload) and again.corrupt_blocks == 0
    assert [len(layer) for layer in again.layers] == [2, 6, 4]
    # each block's checksum now also covers the hash it travels under (its identity)
    assert [again.block(i).checksum for i in range(3)] == [b.keyed(11 + i).checksum for i, b in enumerate(blocks)]
    disk = DiskTier(tmp_path, 1 << 20)
    disk.put(7, blocks[1])
    got = DiskTier(tmp_path, 1 << 20).get(7)  # reopened: read back from the file
    assert got is not None and got.checksum == blocks[1].keyed(7).checksum and got.intact() and got.block_hash == 7
    assert [tuple(t.shape) for layer in got.layers for t in layer] == [
        tuple(t.shape) for layer in blocks[1].layers for t in layer]
    assert got.layers[2][3].dtype == torch.bfloat16

    # Bounded sliding windows: blocks 0 and 1 were offloaded after their window passed (their
    # windowed parts, here the sliding layer's k and v and the compressors' rows, as 0 rows).
    from moebus.kv.payload import block_size_of, missing_part

    groups = [(1, 1), (1, 1, 1, 0, 1, 0), (1, 1, 1, 0)]
    strip = lambda b: KVBlock([tuple(missing_part(t) if g else t for t, g in zip(kv, gs, strict=True))  # noqa: E731
                                     for kv, gs in zip(b.layers, groups, strict=True)])
    mixed = [strip(blocks[0]), strip(blocks[1]), blocks[2]]
    assert block_size_of(mixed) == BLOCK and block_size_of(mixed[:2]) == 0
    payload = KVPayload.from_blocks(mixed, [11, 12, 13], block_size_of(mixed))
    assert payload.window_start == 2 and payload.groups == groups and payload.layers[0][0].shape[0] == 1
    again = KVPayload.from_bytes(payload.to_bytes())
    assert again.equal(payload) and again.corrupt_blocks == 0
    for i, b in enumerate(mixed):
        got = again.block(i)
        assert got.checksum == b.keyed(11 + i).checksum and got.intact() and got.has_window(groups) == (i == 2)
        assert [tuple(t.shape) for layer in got.layers for t in layer] == [
            tuple(t.shape) for layer in b.layers for t in layer]
