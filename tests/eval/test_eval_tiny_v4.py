"""The tiny DeepSeek-V4 rows against HF transformers fp32 on synthetic token ids: v4 agrees with HF,
MTP speculation and an EP=2 group (2 gloo processes) give v4's greedy tokens exactly.

CI-sized: one 64-token chunk (31 tokens scored through decode steps), 6 prompts x 12 tokens; the
prompts run 4..80 tokens, most past the 16-token sliding window.
"""
from __future__ import annotations

import dataclasses

import pytest

from moebus.eval import tiny_v4
from moebus.eval.ep import _mine
from moebus.eval.run import Settings

pytest.importorskip("transformers")

SETTINGS = Settings(ctx=64, max_chunks=1, max_prompts=6, max_tokens=12, synthetic=True)


@pytest.fixture(scope="module")
def rows(one_torch_thread, eval_rows, tmp_path_factory: pytest.TempPathFactory):
    path = tiny_v4.write_checkpoint(tmp_path_factory.mktemp("tiny_v4"))
    return eval_rows(dataclasses.replace(SETTINGS, model=str(path)))


def _full_length(tokens: list[list[int]]) -> bool:
    return len(tokens) == SETTINGS.max_prompts and all(len(t) == SETTINGS.max_tokens for t in tokens)


def test_v4_fp32_matches_hf_fp32(rows) -> None:
    r = rows("v4")
    assert _full_length(r.tokens)
    assert not r.greedy.real, r.greedy.real  # every prompt matched, or diverged at a tie
    assert r.ppl.kl < 1e-6 and r.ppl.same_top_pct == 100.0


def test_mtp_keeps_v4s_greedy_tokens(rows) -> None:
    r = rows("v4-mtp")
    assert r.counters["drafted"] >= SETTINGS.max_prompts * 3  # the nextn layer drafted (3 a step)
    assert r.tokens == rows("v4").tokens


def test_ep2_keeps_v4s_greedy_tokens(rows) -> None:
    r = rows("v4-ep2")
    assert r.counters == {"ranks": 2, "moe_layers": 4, "expert_slots_per_rank": 4}  # 8 experts split in two
    assert r.tokens == rows("v4").tokens
    assert abs(r.ppl.nll - rows("v4").ppl.nll) < 1e-5  # the EP ranks scored the same text


def test_ep_rounds_keep_the_ranks_in_step() -> None:
    assert _mine(0, 2, 5) == [(0, True), (2, True), (4, True)]
    assert _mine(1, 2, 5) == [(1, True), (3, True), (4, False)]  # re-runs the last item, drops it
    assert _mine(1, 2, 1) == [(0, False)]
