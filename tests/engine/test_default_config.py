"""The default configuration (dtype and weight format auto, as `./run up` and `./run generate` run
it: on AVX-512 CPUs without AMX the GGUF's blocks, platforms/format_choice.py) answers the
README's question right, and is batch invariant: a greedy request's tokens, and a seeded request's
samples, are the same alone and batched with others (platforms/cpu/packed_linear.py: where the panel kernel is
taken it serves every row count; engine/lm_head.py: float32 logits). Run in the dtype `auto` picks,
bf16 on AVX512-BF16 CPUs, where rounding made batched and lone greedy output differ (10 of 16 equal)."""
from __future__ import annotations

import pytest

from moebus.engine.llm import LLM
from moebus.engine.sampling import SamplingParams
from moebus.platforms.cpu.packed_linear import panels_wanted

PROMPTS = [[{"role": "user", "content": q}] for q in (
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "Explain what a neural network is in one sentence.", "Name a mammal that lives in the sea.",
    "How many legs does a spider have?", "Give me a synonym for happy.", "What is 12 times 12?")]


@pytest.fixture(scope="module")
def auto_llm() -> LLM:
    return LLM(dtype="auto", weight_format="auto")


def _needs_invariant_kernels(llm: LLM) -> None:
    if llm.engine.config.dtype == "bfloat16" and not panels_wanted(llm.engine.config.torch_dtype):
        pytest.skip("bf16 here runs on oneDNN's GEMMs, whose blocking follows the row count (AMX)")


def test_the_readme_question_is_answered_right(auto_llm):
    """bf16 logits rounded to bf16 answered "L'Étoile, la Marseillaise, la femme," here."""
    out = auto_llm.chat([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30))
    assert "Paris" in out[0].outputs[0].text


def _ids(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(c)) for c in PROMPTS]


def test_greedy_tokens_are_the_same_alone_and_batched(auto_llm):
    _needs_invariant_kernels(auto_llm)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = _ids(auto_llm)
    together = [r.outputs[0].token_ids for r in auto_llm.generate(ids, greedy)]
    alone = [auto_llm.generate([p], greedy)[0].outputs[0].token_ids for p in ids]
    assert [len(t) for t in together] == [24] * len(ids)
    assert together == alone


def test_a_seeded_request_samples_the_same_alone_and_beside_others(auto_llm):
    _needs_invariant_kernels(auto_llm)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    others = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True)
    ids = _ids(auto_llm)
    alone = auto_llm.generate([ids[1]], seeded)[0].outputs[0].token_ids
    beside = auto_llm.generate(ids, [others, seeded, *[others] * (len(ids) - 2)])[1].outputs[0].token_ids
    assert len(alone) == 24 and beside == alone
