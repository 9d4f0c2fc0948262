"""Parity of our paged DeepSeek-V4 compressed attention (CSA with the lightning indexer, HCA) with
HF's DeepseekV4ForCausalLM on a tiny random checkpoint that mixes all three attention kinds.

Layers: sliding, CSA, HCA, CSA; sliding window 16, CSA rate 4 (index_topk 4 of up to 33 entries,
8 indexer heads), HCA rate 32 (longer than a 16-token block; CSA's is shorter). Prompts of 100
tokens cross the window six times, 25 CSA windows and 3 HCA windows.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from moebus.engine.attention import AttentionMetadata
from moebus.engine.model_runner import allocate_kv_caches
from moebus.engine.models.deepseek_v4 import DeepseekV4Args, DeepseekV4ForCausalLM
from moebus.engine.models.hf_checkpoint import read_hf_checkpoint, write_tiny_deepseek_v4

BLOCK = 16
MAX_BLOCKS = 10  # per sequence: 160 tokens
TOL = 1e-4
KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"]
OVERRIDES = dict(layer_types=KINDS, index_n_heads=8, index_topk=4,
                 compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp("dsv4c"), seed=0, **OVERRIDES)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import DeepseekV4ForCausalLM as HFModel

    model = HFModel.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def model(ckpt) -> DeepseekV4ForCausalLM:
    config, state = read_hf_checkpoint(ckpt)
    m = DeepseekV4ForCausalLM(DeepseekV4Args.from_hf_config(config)).eval()
    m.load_weights(state)
    return m


def caches(model: DeepseekV4ForCausalLM, num_seqs: int) -> list[tuple[torch.Tensor, ...]]:
    return allocate_kv_caches(model.kv_cache_specs(), num_seqs * MAX_BLOCKS, BLOCK, torch.float32,
                              torch.device("cpu"))


def step_meta(ctx_lens: list[int], new_lens: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """Sequence b owns blocks [b*MAX_BLOCKS, (b+1)*MAX_BLOCKS) in reverse order (so a sequence's
    blocks are not contiguous), has ctx_lens[b] tokens cached and writes new_lens[b] more."""
    tables = torch.arange(len(ctx_lens) * MAX_BLOCKS, dtype=torch.int32).view(len(ctx_lens), MAX_BLOCKS).flip(1)
    pos = [torch.arange(c, c + n) for c, n in zip(ctx_lens, new_lens, strict=True)]
    slots = torch.cat([tables[b, p // BLOCK].long() * BLOCK + p % BLOCK for b, p in enumerate(pos)])
    seq_lens = [c + n for c, n in zip(ctx_lens, new_lens, strict=True)]
    meta = AttentionMetadata(query_start_loc=[0, *itertools.accumulate(new_lens)], seq_lens=seq_lens,
                             slot_mapping=slots, block_tables=tables,
                             seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32), block_size=BLOCK)
    return meta, torch.cat(pos)


@torch.no_grad()
def run(model, ids: torch.Tensor, ctx_lens: list[int], new_lens: list[int], kv) -> torch.Tensor:
    meta, positions = step_meta(ctx_lens, new_lens)
    return model.compute_logits(model(ids, positions, meta, kv))


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None]).logits[0].float()


def test_checkpoint_has_every_compressed_tensor(ckpt, hf_model, model):
    _, state = read_hf_checkpoint(ckpt)
    assert sorted(state) == sorted(hf_model.state_dict())
    names = set(state)
    assert "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight" in names
    assert "model.layers.2.self_attn.compressor.position_bias" in names
    assert model.layers[2].self_attn.compressor.rate == 32


def test_prefill_logits_match_hf(model, hf_model):
    ids = prompt(100, seed=1)
    ours = run(model, ids, [0], [100], caches(model, 1))
    diff = (ours - hf_logits(hf_model, ids)).abs().max().item()
    print(f"max abs logit diff vs HF (sliding + CSA + HCA, 100 tokens): {diff:.3e}")
    assert diff < TOL


def test_indexer_topk_matters(model, hf_model):
    """The comparison above can fail: with a larger top-k the same weights give other logits."""
    ids = prompt(100, seed=1)
    indexers = [layer.self_attn.compressor.indexer for layer in model.layers
                if layer.kind == "compressed_sparse_attention"]
    for ix in indexers:
        ix.topk = 8
    try:
        ours = run(model, ids, [0], [100], caches(model, 1))
    finally:
        for ix in indexers:
            ix.topk = 4
    assert (ours - hf_logits(hf_model, ids)).abs().max().item() > 100 * TOL


def test_greedy_decode_matches_hf_generate(model, hf_model):
    ids, n_new = prompt(90, seed=2), 32  # decode crosses CSA and HCA window boundaries (96, 120)
    with torch.no_grad():
        ref = hf_model.generate(ids[None], do_sample=False, max_new_tokens=n_new)[0, 90:].tolist()
    kv = caches(model, 1)
    tok = run(model, ids, [0], [90], kv)[-1].argmax().item()
    out = [tok]
    for step in range(n_new - 1):
        assert step_meta([90 + step], [1])[0].decode_only
        tok = run(model, torch.tensor([tok]), [90 + step], [1], kv)[-1].argmax().item()
        out.append(tok)
    assert out == ref


def test_chunked_prefill_matches_hf(model, hf_model):
    ids = prompt(100, seed=3)
    ref = hf_logits(hf_model, ids)
    kv, outs, done = caches(model, 1), [], 0
    for n in (37, 1, 3, 26, 33):  # chunk ends inside windows, on them, and inside blocks
        outs.append(run(model, ids[done:done + n], [done], [n], kv))
        done += n
    assert (torch.cat(outs) - ref).abs().max().item() < TOL


def test_flattened_batch_matches_each_alone(model):
    a, b = prompt(100, seed=4), prompt(45, seed=5)
    alone_a = run(model, a, [0], [100], caches(model, 1))
    alone_b = run(model, b, [0], [45], caches(model, 1))
    kv = caches(model, 2)
    both = run(model, torch.cat([a, b]), [0, 0], [100, 45], kv)
    assert (both[:100] - alone_a).abs().max().item() < TOL
    assert (both[100:] - alone_b).abs().max().item() < TOL
    # Mixed step: sequence 0 decodes its 101st token while sequence 1 prefills 20 more from its
    # cache, closing CSA windows and the HCA window that ends at position 63.
    a2, b2 = prompt(1, seed=6), prompt(20, seed=7)
    mixed = run(model, torch.cat([a2, b2]), [100, 45], [1, 20], kv)
    ref_a = run(model, torch.cat([a, a2]), [0], [101], caches(model, 1))[-1:]
    ref_b = run(model, torch.cat([b, b2]), [0], [65], caches(model, 1))[-20:]
    assert (mixed - torch.cat([ref_a, ref_b])).abs().max().item() < TOL


def test_kv_spec_per_layer_kind(model):
    specs = model.kv_cache_specs()
    assert [len(s.planes) for s in specs] == [0, 4, 2, 4]
    hca = specs[2]
    assert hca.v_dim == 0 and [p.tokens_per_row for p in hca.planes] == [1, 32]
    kv = caches(model, 1)
    assert kv[1][3].shape[1:] == (BLOCK // 4, model.config.head_dim)  # CSA entries: 4 per block
    assert kv[2][3].shape[1:] == (1, model.config.head_dim)  # HCA entries: one block in two holds one


def test_yarn_compress_rope_matches_hf(tmp_path):
    """The released checkpoints scale the compress rope with YaRN (HF pins attention_factor 1)."""
    from transformers import DeepseekV4ForCausalLM as HFModel

    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    path = write_tiny_deepseek_v4(tmp_path, seed=5, rope_parameters=yarn, compress_rope_theta=1000.0,
                                  max_position_embeddings=512, **OVERRIDES)
    hf = HFModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    config, state = read_hf_checkpoint(path)
    args = DeepseekV4Args.from_hf_config(config)
    assert args.compress_rope.yarn_factor == 16.0 and args.compress_rope.theta == 1000.0
    assert args.rope_theta == 10000.0
    torch.testing.assert_close(args.compress_rope.inv_freq(args.rope_dim), hf.model.rotary_emb.compress_inv_freq,
                               atol=0, rtol=0)
    ours = DeepseekV4ForCausalLM(args).eval()
    ours.load_weights(state)
    ids = prompt(100, seed=8)
    diff = (run(ours, ids, [0], [100], caches(ours, 1)) - hf_logits(hf, ids)).abs().max().item()
    print(f"max abs logit diff vs HF with a YaRN compress rope: {diff:.3e}")
    assert diff < TOL
