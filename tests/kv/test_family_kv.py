"""Each MoE family's KV cache layout through disaggregation and the KV tiers: prefill on engine A,
ship the payload over shared memory, decode on engine B == one aggregated engine; blocks offloaded
to the CPU and disk tiers, evicted, restored == the cold run, with only the rest recomputed."""
from __future__ import annotations

import pytest
import torch

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.models.tiny_checkpoints import FAMILIES, write_tiny
from moebus.engine.sampling import SamplingParams
from moebus.kv.tiers.cpu import CpuTier
from moebus.kv.tiers.disk import DiskTier
from moebus.kv.tiers.load import load_prefix
from moebus.kv.tiers.offload import KVOffloader
from moebus.kv.tiers.store import TieredKVStore
from moebus.kv.transfer import inject_prefilled, prefill

from .conftest import over_shm, run

BLOCK = 16
N = 100  # 6 full blocks and a partial one
GREEDY16 = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request, tmp_path_factory: pytest.TempPathFactory):
    ckpt = str(write_tiny(request.param, tmp_path_factory.mktemp(request.param), seed=2))
    cfg = EngineConfig(model=ckpt, num_kv_blocks=48, block_size=BLOCK, max_num_batched_tokens=4096)
    a, b = LLMEngine(cfg), LLMEngine(cfg)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(3, 500, (N,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def reference(engines, prompt) -> list[int]:
    _, b = engines
    b.block_manager.reset_prefix_cache()
    out = run(b, "ref", prompt, GREEDY16).tokens
    b.block_manager.reset_prefix_cache()
    assert len(out) == 16
    return out


def test_disaggregated_matches_aggregated(engines, prompt, reference):
    a, b = engines
    pre = prefill(a, "p", prompt, GREEDY16)
    assert pre.first_token == reference[0]
    assert [tuple(t.shape[2:]) for t in pre.payload.layers[0]] == [tuple(c.shape[2:]) for c in a.kv_caches[0]]
    got = over_shm(pre.payload, "moebus-famkv-agg", "agg")
    assert got.equal(pre.payload) and got.corrupt_blocks == 0
    res = inject_prefilled(b, "d", prompt, pre.first_token, GREEDY16, got)
    assert res.injected, res.reason
    out = run(b, "d")
    assert [pre.first_token] + out.tokens == reference
    assert out.computed == GREEDY16.max_tokens - 1  # decode steps only: no prompt recompute
    b.block_manager.reset_prefix_cache()


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_tier_restore_matches_cold(engines, prompt, tier, tmp_path):
    _, engine = engines
    store = TieredKVStore([CpuTier(64 << 20) if tier == "cpu" else DiskTier(tmp_path, 64 << 20)])
    engine.block_manager.reset_prefix_cache()
    offloader = KVOffloader(store)
    cold = run(engine, f"{tier}-cold", prompt, GREEDY16, after_step=lambda: offloader.offload(engine)).tokens
    engine.block_manager.reset_prefix_cache()  # evicted from the device: only the tier has them
    assert len(store.tiers[0]) == (N + 15) // BLOCK
    loaded: list[int] = []
    out = run(engine, f"{tier}-warm", prompt, GREEDY16,
              before_step=lambda: loaded.append(load_prefix(engine, f"{tier}-warm", store)))
    engine.block_manager.reset_prefix_cache()
    assert loaded == [(N - 1) // BLOCK * BLOCK]
    assert out.tokens == cold
    assert out.computed == N - loaded[0] + GREEDY16.max_tokens - 1
