"""EP + attention DP on 2 and 4 gloo ranks equals the single-process model; EPLB mid-generation.

One group launch per world size runs every phase (launches dominate the runtime):
1. forward: each rank runs its own 2-sequence batch through the EP model (then rank 0 sits one
   step out with a dummy forward) -> logits vs the single-process model;
2. engine: each rank serves different requests with different lengths -> greedy tokens vs a
   single-process engine on that rank's requests (ranks that finish early run dummy steps);
3. EPLB: skewed prompts (2 token ids -> few hash-routed experts); measure per-rank load, rebalance
   while those requests are mid-generation, submit more skewed requests, measure again.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from moebus.engine.attention import AttentionMetadata
from moebus.engine.distributed.dp_engine import DPEngine, EPConfig
from moebus.engine.distributed.ep_moe import dummy_forward
from moebus.engine.distributed.launcher import launch_ep_group
from moebus.engine.models.deepseek_v4 import DeepseekV4Args, DeepseekV4ForCausalLM
from moebus.engine.models.hf_checkpoint import read_hf_checkpoint

from .common import ENGINE_KWARGS, PRELOAD, greedy, prompt, reference_tokens

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

BLOCK = 16
HOT_TOKENS = [7, 11]


def fwd_lens(rank: int) -> list[int]:
    return [3 + 4 * rank, 17]


def engine_requests(rank: int) -> list[tuple[str, list[int], int]]:
    return [(f"r{rank}-a", prompt(5 + 3 * rank, seed=rank), 3 + 3 * rank),
            (f"r{rank}-b", prompt(21, seed=100 + rank), 6 + rank)]


def eplb_requests(rank: int, phase: int) -> list[tuple[str, list[int], int]]:
    return [(f"eplb{phase}-r{rank}-{i}", prompt(24, seed=1000 * phase + 10 * rank + i, vocab=HOT_TOKENS),
             10 if phase == 1 else 3) for i in range(2)]


def auto_requests(rank: int) -> list[tuple[str, list[int], int]]:
    return [(f"auto-r{rank}-{i}", prompt(16, seed=5000 + 10 * rank + i, vocab=HOT_TOKENS), 5) for i in range(2)]


@torch.inference_mode()
def batch_logits(model: torch.nn.Module, lens: list[int], seed: int) -> np.ndarray:
    """Prefill len(lens) sequences in one flattened batch (fresh KV); all positions' logits."""
    blocks = [(n + BLOCK - 1) // BLOCK for n in lens]
    starts = [0, *itertools.accumulate(blocks)]
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.arange(starts[b], starts[b] + n)
    pos = [torch.arange(n) for n in lens]
    slots = torch.cat([tables[b, p // BLOCK].long() * BLOCK + p % BLOCK for b, p in enumerate(pos)])
    meta = AttentionMetadata([0, *itertools.accumulate(lens)], list(lens), slots, tables,
                             torch.tensor(lens, dtype=torch.int32), BLOCK)
    kv = [(torch.zeros(starts[-1], BLOCK, s.num_kv_heads, s.k_dim), torch.zeros(starts[-1], BLOCK, s.num_kv_heads, s.v_dim))
          for s in model.kv_cache_specs()]
    ids = torch.cat([torch.tensor(prompt(n, seed=seed + b)) for b, n in enumerate(lens)])
    return model.compute_logits(model(ids, torch.cat(pos), meta, kv)).numpy()


def run_tokens(engine: DPEngine, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    for rid, ids, n in requests:
        engine.add_request(rid, ids, greedy(n))
    return engine.run_to_completion()


def rank_main(engine: DPEngine) -> dict:
    rank, model = engine.group.rank, engine.engine.model
    out: dict = {"logits": batch_logits(model, fwd_lens(rank), seed=10 * rank)}
    if rank == 0:  # one more model step where rank 0 has no tokens
        dummy_forward(engine.layers)
    else:
        out["logits2"] = batch_logits(model, [5], seed=77 * rank)
    out["tokens"] = run_tokens(engine, engine_requests(rank))
    out["dummy_steps"] = engine.dp_stats.dummy_steps
    # EPLB: phase-1 requests run 3 steps, then rebalance mid-generation, then phase 2 joins.
    engine.reset_loads()
    for rid, ids, n in eplb_requests(rank, 1):
        engine.add_request(rid, ids, greedy(n))
    eplb_tokens: dict[str, list[int]] = {}
    for _ in range(3):
        for o in engine.step():
            eplb_tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    out["measured_before"] = engine.load_imbalance()
    reports = engine.rebalance(min_gain=0.0)
    out["planned"] = [(r.imbalance_before, r.imbalance_after, r.num_moves) for r in reports]
    for rid, ids, n in eplb_requests(rank, 2):
        engine.add_request(rid, ids, greedy(n))
    for _ in range(3):
        for o in engine.step():
            eplb_tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    out["measured_after"] = engine.load_imbalance()
    for rid, toks in engine.run_to_completion().items():
        eplb_tokens.setdefault(rid, []).extend(toks)
    out["eplb_tokens"] = eplb_tokens
    # Automatic EPLB every 2 group steps while requests run.
    engine.ep = dataclasses.replace(engine.ep, eplb_interval=2, eplb_min_gain=0.0)
    done = len(engine.dp_stats.rebalances)
    out["auto_tokens"] = run_tokens(engine, auto_requests(rank))
    out["auto_rebalances"] = len(engine.dp_stats.rebalances) - done
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ep_run(request: pytest.FixtureRequest, moe_ckpt) -> tuple[int, list[dict]]:
    world = request.param
    results = launch_ep_group(str(moe_ckpt), world, rank_main, engine_kwargs=ENGINE_KWARGS,
                              ep=EPConfig(num_redundant_experts=world, count_loads=True),
                              start_method="forkserver", preload=PRELOAD, timeout_s=150)
    return world, results


@pytest.fixture(scope="module")
def reference(moe_ckpt) -> dict[str, list[int]]:
    """Single-process greedy tokens of every request any rank serves (one engine run: greedy
    tokens do not depend on the batch a request shares)."""
    reqs = [r for rank in range(4) for r in engine_requests(rank) + eplb_requests(rank, 1)
            + eplb_requests(rank, 2) + auto_requests(rank)]
    return reference_tokens(moe_ckpt, reqs)


def expected(reference: dict[str, list[int]], reqs: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    return {rid: reference[rid] for rid, _, _ in reqs}


@pytest.fixture(scope="module")
def plain_model(moe_ckpt) -> DeepseekV4ForCausalLM:
    config, state = read_hf_checkpoint(moe_ckpt)
    model = DeepseekV4ForCausalLM(DeepseekV4Args.from_hf_config(config)).eval()
    model.load_weights(state)
    return model


def test_forward_logits_match_single_process(ep_run, plain_model):
    world, results = ep_run
    for rank, res in enumerate(results):
        want = batch_logits(plain_model, fwd_lens(rank), seed=10 * rank)
        err = float(np.abs(res["logits"] - want).max())
        print(f"ep{world} rank {rank}: max |logits diff| {err:.2e}")
        assert err < 1e-5
        if rank:
            assert float(np.abs(res["logits2"] - batch_logits(plain_model, [5], seed=77 * rank)).max()) < 1e-5


def test_greedy_tokens_match_single_process(ep_run, reference):
    world, results = ep_run
    for rank, res in enumerate(results):
        reqs = engine_requests(rank)
        assert res["tokens"] == expected(reference, reqs)
        assert [len(res["tokens"][rid]) for rid, _, _ in reqs] == [n for _, _, n in reqs]
    assert results[0]["dummy_steps"] > 0  # rank 0 has the shortest requests: it idled while others ran


def test_eplb_lowers_imbalance_and_keeps_outputs(ep_run, reference):
    world, results = ep_run
    before, after = results[0]["measured_before"], results[0]["measured_after"]
    planned = results[0]["planned"]
    print(f"ep{world}: measured max/mean rank load {before:.3f} -> {after:.3f}; planned per layer "
          + ", ".join(f"{b:.2f}->{a:.2f} ({m} moves)" for b, a, m in planned))
    assert all(r["planned"] == planned for r in results)  # every rank made the same plan
    assert after < before
    assert sum(m for _, _, m in planned) > 0
    for rank, res in enumerate(results):
        reqs = eplb_requests(rank, 1) + eplb_requests(rank, 2)
        assert res["eplb_tokens"] == expected(reference, reqs)  # none dropped, same tokens
        assert res["auto_rebalances"] >= 2
        assert res["auto_tokens"] == expected(reference, auto_requests(rank))


def failing_rank_main(engine: DPEngine) -> None:
    if engine.group.rank == 1:
        raise ValueError("boom")
    run_tokens(engine, engine_requests(0))  # blocks in a collective that rank 1 never joins


def test_launcher_reports_a_failed_rank_and_stops_the_group(moe_ckpt):
    with pytest.raises(RuntimeError, match="EP rank 1 failed(.|\n)*boom"):
        launch_ep_group(str(moe_ckpt), 2, failing_rank_main, engine_kwargs=ENGINE_KWARGS,
                        start_method="forkserver", preload=PRELOAD, timeout_s=60)
