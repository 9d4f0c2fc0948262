"""EP=2 (attention DP + expert parallel over gloo) on each MoE family's tiny checkpoint: every
rank's greedy tokens equal a single-process engine's, and an EPLB rebalance mid-generation
changes no token."""
from __future__ import annotations

import pytest

from moebus.engine.distributed.dp_engine import DPEngine, EPConfig
from moebus.engine.distributed.launcher import launch_ep_group
from moebus.engine.models.tiny_checkpoints import FAMILIES, write_tiny

from .common import ENGINE_KWARGS, PRELOAD, greedy, prompt, reference_tokens

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow


def requests(rank: int) -> list[tuple[str, list[int], int]]:
    return [(f"r{rank}-a", prompt(5 + 3 * rank, seed=rank), 4 + 3 * rank),
            (f"r{rank}-b", prompt(21, seed=100 + rank), 8 + rank)]


def rank_main(engine: DPEngine) -> dict:
    rank = engine.group.rank
    for rid, ids, n in requests(rank):
        engine.add_request(rid, ids, greedy(n))
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    moves = sum(r.num_moves for r in engine.rebalance(min_gain=0.0))
    for rid, toks in engine.run_to_completion().items():
        tokens.setdefault(rid, []).extend(toks)
    return {"tokens": tokens, "moves": moves}


@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_matches_single_process(family, tmp_path):
    ckpt = write_tiny(family, tmp_path / family, seed=3)
    results = launch_ep_group(str(ckpt), 2, rank_main, engine_kwargs=ENGINE_KWARGS,
                              ep=EPConfig(num_redundant_experts=2, count_loads=True),
                              start_method="forkserver", preload=PRELOAD, timeout_s=150)
    reference = reference_tokens(ckpt, [r for rank in range(2) for r in requests(rank)])
    for rank, res in enumerate(results):
        assert res["tokens"] == {rid: reference[rid] for rid, _, _ in requests(rank)}
    assert results[0]["moves"] > 0  # the rebalance moved experts while requests ran
