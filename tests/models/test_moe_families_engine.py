"""The engine (scheduler, block manager, model runner) on each MoE family's tiny checkpoint:
batched and chunked prefill, prefix-cache hits, preemption with recompute, n-gram speculation
and deterministic mode all give the tokens of a cold, alone, unchunked run."""
from __future__ import annotations

import pytest
import torch

from moebus.engine.llm import LLM
from moebus.engine.models.tiny_checkpoints import FAMILIES, write_tiny
from moebus.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
KV_BLOCKS = 64


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny(request.param, tmp_path_factory.mktemp(request.param), seed=1))


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def tokens(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(ps, params)]


def engine(ckpt: str, **kw) -> LLM:
    return LLM(ckpt, **{"max_num_batched_tokens": 4096, "num_kv_blocks": KV_BLOCKS, **kw})


@pytest.fixture(scope="module")
def alone(ckpt):
    """Each prompt alone on a cold engine without prefix caching, whole prompt in one step."""
    llm = engine(ckpt, enable_prefix_caching=False)
    return lambda ps, params=GREEDY: [tokens(llm, [p], params)[0] for p in ps]


def test_batched_and_chunked_prefill_match_alone(ckpt, alone):
    ps = prompts(1, (100, 37, 140))
    llm = engine(ckpt, enable_prefix_caching=False, max_num_batched_tokens=45)  # long prompts in chunks
    assert tokens(llm, ps) == alone(ps)


def test_prefix_cache_hit_matches_cold_run(ckpt, alone):
    base = prompts(2, (120,))[0]
    branch = base[:100] + prompts(3, (30,))[0]  # 6 full blocks shared, then different
    expected = alone([base, branch])
    llm = engine(ckpt)
    assert tokens(llm, [base]) == expected[:1]
    hits = llm.engine.stats()["prefix_cache_hits"]
    assert tokens(llm, [branch]) == expected[1:]
    assert llm.engine.stats()["prefix_cache_hits"] == hits + 1
    assert tokens(llm, [base]) == expected[:1]  # the branch did not write into the shared blocks


def test_preemption_recompute_matches_alone(ckpt, alone, run_counting_preemptions):
    ps = prompts(4, (95, 94, 93))
    llm = engine(ckpt, enable_prefix_caching=False, num_kv_blocks=13)  # two 6-block prompts, then one yields
    out, preempted = run_counting_preemptions(llm.engine, ps, GREEDY)
    assert preempted > 0
    assert out == alone(ps)


def test_ngram_speculation_leaves_greedy_output_unchanged(ckpt, alone):
    motif = prompts(6, (12,))[0]
    ps = [motif * 8 + motif[:5], prompts(7, (97,))[0]]  # a repetitive prompt draws n-gram drafts
    params = SamplingParams(temperature=0.0, max_tokens=16)
    llm = engine(ckpt, enable_prefix_caching=False, num_speculative_tokens=3)
    assert tokens(llm, ps, params) == alone(ps, params)
    assert llm.engine.spec_stats.num_draft_tokens > 0


def test_deterministic_mode_is_batch_invariant(ckpt):
    llm = engine(ckpt, deterministic=True)
    ps = prompts(5, (100, 23, 70))
    p = SamplingParams(temperature=0.8, seed=11, max_tokens=6, logprobs=1)
    alone_out = llm.generate([ps[2]], p)[0].outputs[0]
    crowd = llm.generate(ps * 2, p)[2].outputs[0]
    assert crowd.token_ids == alone_out.token_ids
    assert crowd.logprobs == alone_out.logprobs  # bitwise: same floats
