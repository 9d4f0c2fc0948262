"""The engine (scheduler, block manager, model runner) on a DeepSeek-V4 checkpoint mixing sliding,
CSA and HCA layers: prefix-cache hits, preemption with recompute, chunked prefill, batching and
deterministic mode all give the tokens of a cold, alone, unchunked run. Prompts of 100-140 tokens
cross the 16-token window and several CSA (4) and HCA (32) windows."""
from __future__ import annotations

import pytest
import torch

from moebus.engine.llm import LLM
from moebus.engine.models.hf_checkpoint import write_tiny_deepseek_v4
from moebus.engine.sampling import SamplingParams

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
KV_BLOCKS = 64  # 1024 tokens: enough for every test here, and quick to allocate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return str(write_tiny_deepseek_v4(
        tmp_path_factory.mktemp("dsv4e"), seed=1, layer_types=KINDS, index_n_heads=8, index_topk=4,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32}))


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def tokens(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(ps, params)]


@pytest.fixture(scope="module")
def alone(ckpt):
    """Each prompt alone on a cold engine without prefix caching, whole prompt in one step."""
    llm = LLM(ckpt, tokenizer="smollm2", enable_prefix_caching=False, max_num_batched_tokens=4096, num_kv_blocks=KV_BLOCKS)
    return lambda ps: [tokens(llm, [p])[0] for p in ps]


def test_batched_and_chunked_prefill_match_alone(ckpt, alone):
    ps = prompts(1, (100, 37, 140))
    expected = alone(ps)
    llm = LLM(ckpt, tokenizer="smollm2", enable_prefix_caching=False, max_num_batched_tokens=45, num_kv_blocks=KV_BLOCKS)
    assert tokens(llm, ps) == expected  # 45-token budget: every long prompt is prefilled in chunks


def test_prefix_cache_hit_matches_cold_run(ckpt, alone):
    base = prompts(2, (120,))[0]
    # shares 6 full blocks (96 tokens: 24 CSA and 3 HCA windows) with `base`, then differs
    branch = base[:100] + prompts(3, (30,))[0]
    expected = alone([base, branch])
    llm = LLM(ckpt, tokenizer="smollm2", max_num_batched_tokens=4096, num_kv_blocks=KV_BLOCKS)
    assert tokens(llm, [base]) == expected[:1]
    hits = llm.engine.stats()["prefix_cache_hits"]
    assert tokens(llm, [branch]) == expected[1:]
    assert llm.engine.stats()["prefix_cache_hits"] == hits + 1
    assert tokens(llm, [base]) == expected[:1]  # the branch did not write into the shared blocks


def test_preemption_recompute_matches_alone(ckpt, alone, run_counting_preemptions):
    ps = prompts(4, (95, 94, 93))
    expected = alone(ps)
    # 13 blocks of 16 tokens: two 6-block prompts run, and when both cross token 96 one of them
    # has to give its blocks back and recompute
    llm = LLM(ckpt, tokenizer="smollm2", enable_prefix_caching=False, num_kv_blocks=13,
              max_num_batched_tokens=4096)
    out, preempted = run_counting_preemptions(llm.engine, ps, GREEDY)
    assert preempted > 0
    assert out == expected


def test_deterministic_mode_is_batch_invariant(ckpt):
    llm = LLM(ckpt, tokenizer="smollm2", deterministic=True, max_num_batched_tokens=4096, num_kv_blocks=KV_BLOCKS)
    ps = prompts(5, (100, 23, 70))
    p = SamplingParams(temperature=0.8, seed=11, max_tokens=6, logprobs=1)
    # alone, the 70-token prompt sees 2 HCA entries at most; in the crowd others see 3
    alone_out = llm.generate([ps[2]], p)[0].outputs[0]
    crowd = llm.generate(ps * 2, p)[2].outputs[0]
    assert crowd.token_ids == alone_out.token_ids
    assert crowd.logprobs == alone_out.logprobs  # bitwise: same floats


def test_speculative_drafts_leave_greedy_output_unchanged(ckpt):
    """Rejected n-gram drafts write K, compressor rows and entries past the accepted tokens (some
    close windows); the next step rewrites them before any query can see them."""
    motif = prompts(6, (12,))[0]
    ps = [motif * 8 + motif[:5], prompts(7, (97,))[0]]  # a repetitive prompt draws n-gram drafts
    params = SamplingParams(temperature=0.0, max_tokens=16)
    plain = LLM(ckpt, tokenizer="smollm2", enable_prefix_caching=False, num_kv_blocks=KV_BLOCKS)
    expected = [tokens(plain, [p], params)[0] for p in ps]
    llm = LLM(ckpt, tokenizer="smollm2", enable_prefix_caching=False, num_speculative_tokens=3,
              num_kv_blocks=KV_BLOCKS)
    assert tokens(llm, ps, params) == expected
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted < stats.num_draft_tokens  # some were rejected


def test_kv_namespace_and_cache_events_cover_the_compressor_planes(ckpt):
    """Workers publish prefix-cache events keyed by the KV namespace (on by default): it must name
    a compressed layer's extra planes, so engines with another layout never share its blocks."""
    llm = LLM(ckpt, tokenizer="smollm2", num_kv_blocks=KV_BLOCKS)
    shapes = llm.engine.kv.namespace.rsplit("|", 1)[1]
    # head_dim 32, index_head_dim 16, 16-token blocks: CSA src = kv|gate of [Ca|Cb] = 4 x 32 per token,
    # 4 entries per block; HCA src 2 x 32 per token, 1 entry row per block (rate 32)
    csa = "(16, 1, 32)/(16, 1, 0)/(16, 128)/(4, 32)/(16, 64)/(4, 16)"
    assert shapes == ",".join(["(16, 1, 32)/(16, 1, 32)", csa, "(16, 1, 32)/(16, 1, 0)/(16, 64)/(1, 32)", csa])
    llm.engine.kv.attach()  # as a worker does: cache events recorded from now on
    llm.engine.add_request("ev", prompts(8, (50,))[0], GREEDY)
    llm.engine.step()  # the prompt's 3 full blocks are computed and cached
    stored, _ = llm.engine.kv.take_events()
    assert len(stored) == 3
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
