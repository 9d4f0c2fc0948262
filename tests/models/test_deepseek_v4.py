"""Parity of our paged DeepSeek-V4 with HF's DeepseekV4ForCausalLM on a tiny random checkpoint.

The checkpoint (hf_checkpoint.write_tiny_deepseek_v4) has 4 sliding-window layers (window 16,
2 hash-MoE + 2 top-k MoE, 8 experts top-2, 1 shared expert, mHC with 4 streams), so prompts of
40 tokens cross the window and three 16-token KV blocks.
"""
from __future__ import annotations

import pytest
import torch

from moebus.engine.models.deepseek_v4 import DeepseekV4Args, DeepseekV4ForCausalLM
from moebus.engine.models.hf_checkpoint import read_hf_checkpoint, write_tiny_deepseek_v4

from .paged_steps import caches, greedy_vs_hf, logits_diff_vs_hf, prompt, run

TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp("dsv4"), seed=0)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import DeepseekV4ForCausalLM as HFModel

    model = HFModel.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # always generate the full 32 tokens
    return model


@pytest.fixture(scope="module")
def model(ckpt) -> DeepseekV4ForCausalLM:
    config, state = read_hf_checkpoint(ckpt)
    m = DeepseekV4ForCausalLM(DeepseekV4Args.from_hf_config(config)).eval()
    m.load_weights(state)
    return m


def test_checkpoint_names_match_hf(ckpt, hf_model):
    _, state = read_hf_checkpoint(ckpt)
    ref = hf_model.state_dict()
    assert sorted(state) == sorted(ref)
    assert all(torch.equal(state[k], ref[k]) for k in ref)


def test_prefill_logits_match_hf(model, hf_model):
    assert logits_diff_vs_hf(model, hf_model, prompt(40, seed=1)) < TOL


def test_greedy_decode_matches_hf_generate(model, hf_model):
    ours, ref = greedy_vs_hf(model, hf_model, prompt(40, seed=2), 32)
    assert ours == ref


def test_chunked_prefill_matches_single_prefill(model):
    ids = prompt(40, seed=3)
    whole = run(model, ids, [0], [40], caches(model, 1))
    kv = caches(model, 1)
    first = run(model, ids[:23], [0], [23], kv)
    second = run(model, ids[23:], [23], [17], kv)  # reads the first 23 tokens from the cache
    assert (torch.cat([first, second]) - whole).abs().max().item() < TOL


def test_flattened_batch_matches_each_alone(model):
    a, b = prompt(40, seed=4), prompt(27, seed=5)
    alone_a = run(model, a, [0], [40], caches(model, 1))
    alone_b = run(model, b, [0], [27], caches(model, 1))
    kv = caches(model, 2)
    both = run(model, torch.cat([a, b]), [0, 0], [40, 27], kv)
    assert (both[:40] - alone_a).abs().max().item() < TOL
    assert (both[40:] - alone_b).abs().max().item() < TOL
    # Mixed step: sequence 0 decodes one token while sequence 1 prefills 5 more from its cache.
    a2, b2 = prompt(1, seed=6), prompt(5, seed=7)
    mixed = run(model, torch.cat([a2, b2]), [40, 27], [1, 5], kv)
    ref_a = run(model, torch.cat([a, a2]), [0], [41], caches(model, 1))[-1:]
    ref_b = run(model, torch.cat([b, b2]), [0], [32], caches(model, 1))[-5:]
    assert (mixed - torch.cat([ref_a, ref_b])).abs().max().item() < TOL


def test_meta_init_and_on_disk_names(ckpt, model):
    """The registry path: build on the meta device, then load the raw safetensors (original names)."""
    from safetensors.torch import load_file

    config, _ = read_hf_checkpoint(ckpt)
    with torch.device("meta"):
        fresh = DeepseekV4ForCausalLM(DeepseekV4Args.from_hf_config(config))
    fresh = fresh.to_empty(device="cpu").eval()
    fresh.load_weights(load_file(ckpt / "model.safetensors"))
    ids = prompt(20, seed=9)
    assert torch.equal(run(fresh, ids, [0], [20], caches(fresh, 1)), run(model, ids, [0], [20], caches(model, 1)))


def test_expert_load_counter(model):
    counters = model.enable_expert_load_counting()
    try:
        run(model, prompt(20, seed=8), [0], [20], caches(model, 1))
        assert [int(c.sum()) for c in counters] == [20 * model.config.num_experts_per_tok] * len(counters)
    finally:
        for layer in model.layers:
            layer.mlp.load_counter = None


def test_load_weights_is_strict(ckpt, model):
    config, state = read_hf_checkpoint(ckpt)
    fresh = DeepseekV4ForCausalLM(DeepseekV4Args.from_hf_config(config))
    with pytest.raises(KeyError, match="missing"):
        fresh.load_weights({k: v for k, v in state.items() if k != "model.norm.weight"})
    with pytest.raises(KeyError, match="unexpected"):
        fresh.load_weights({**state, "model.layers.0.bogus": torch.zeros(1)})
    fresh.load_weights({**state, "mtp.0.emb.weight": torch.zeros(1)})  # draft layers are set aside
    assert list(fresh.mtp_weights) == ["mtp.0.emb.weight"]


def test_compressed_kinds_build_with_their_own_cache_planes(ckpt):
    """Compressed kinds are covered in test_deepseek_v4_compressed.py; a sliding layer keeps K and V only."""
    config, _ = read_hf_checkpoint(ckpt)
    config = {**config, "layer_types": ["sliding_attention"] * 3 + ["compressed_sparse_attention"]}
    specs = DeepseekV4ForCausalLM(DeepseekV4Args.from_hf_config(config)).kv_cache_specs()
    assert [len(s.planes) for s in specs] == [0, 0, 0, 4]


def test_deterministic_mode_is_batch_invariant_for_the_moe(ckpt):
    """Router, shared expert, mHC, grouped o-projection and routed experts all give a token the same
    bits whatever else is batched with it (and whichever expert groups that makes)."""
    from moebus.engine.llm import LLM
    from moebus.engine.sampling import SamplingParams

    llm = LLM(str(ckpt), tokenizer="smollm2", deterministic=True, max_num_batched_tokens=4096)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (23, 40, 17, 31, 9, 52)]
    p = SamplingParams(temperature=0.8, seed=11, max_tokens=12, logprobs=1)
    alone = llm.generate([prompts[1]], p)[0].outputs[0]
    crowd = llm.generate(prompts * 3, p)[1].outputs[0]
    assert crowd.token_ids == alone.token_ids
    assert crowd.logprobs == alone.logprobs  # bitwise: same floats, not merely same samples


def test_fused_greedy_head_matches_the_logits_path(ckpt):
    from moebus.engine.llm import LLM
    from moebus.engine.sampling import SamplingParams

    llm = LLM(str(ckpt), tokenizer="smollm2", max_num_batched_tokens=4096)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (23, 40, 17, 31, 9, 52)]
    p = SamplingParams(temperature=0.0, max_tokens=12)
    fused = [r.outputs[0].token_ids for r in llm.generate(prompts, p)]
    assert llm.engine.runner.greedy_head is not None
    llm.engine.runner.greedy_head = None
    assert [r.outputs[0].token_ids for r in llm.generate(prompts, p)] == fused
