"""The disagg rows on SmolLM2: prefill on one engine, the prompt's KV moved, decode on another give
the aggregated engine's greedy tokens, in float32 and bfloat16; with the moved KV spoiled they do
not (the decode engine really decodes from it).

CI-sized: one 32-token chunk (15 tokens scored through decode steps), 3 prompts x 6 tokens.
"""
from __future__ import annotations

import pytest

from moebus.eval import disagg
from moebus.eval.run import Settings, run_configs

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

pytest.importorskip("transformers")

SETTINGS = Settings(ctx=32, max_chunks=1, max_prompts=3, max_tokens=6)


@pytest.fixture(scope="module")
def rows(one_torch_thread, eval_rows):
    return eval_rows(SETTINGS)


def _moved_every_prompt(counters: dict[str, int]) -> bool:
    return counters["kv_prompts"] == SETTINGS.max_prompts and counters["kv_blocks"] > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_disaggregated_tokens_equal_aggregated(rows, dtype: str) -> None:
    aggregated, split = rows(dtype), rows("disagg" if dtype == "fp32" else "disagg-bf16")
    assert _moved_every_prompt(split.counters)
    assert all(len(t) == SETTINGS.max_tokens for t in split.tokens)
    assert split.tokens == aggregated.tokens


def test_spoiled_kv_changes_the_tokens(rows, monkeypatch: pytest.MonkeyPatch) -> None:
    def prefill_then_zero_kv(*args, **kwargs):
        res = disagg_prefill(*args, **kwargs)
        for layer in res.payload.layers:
            for t in layer:
                t.zero_()
        return res

    disagg_prefill = disagg.prefill
    monkeypatch.setattr(disagg, "prefill", prefill_then_zero_kv)
    spoiled = next(run_configs(SETTINGS, rows.reference, rows.hf_path, ["disagg"]))
    assert _moved_every_prompt(spoiled.counters)
    assert spoiled.tokens != rows("fp32").tokens
