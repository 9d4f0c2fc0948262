"""K-quant GGUFs served on their blocks (weight_format "gguf"): Q4_K tensors rewritten as Q4_1 blocks
at load, Q6_K ones re-quantized to Q8_0 (loader/kquants.py), run on the same kernels as a Q4_1 / Q8_0
file's. A tiny Qwen3-MoE whose rows are whole super-blocks (hidden and expert widths 256), written by
llama.cpp's converter in Q8_0, then its weight matrices re-quantized to Q4_K, or to the Q4_K_M mix
(loadtest/kquant_file.py), against the same file dequantized to float32 by gguf-py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGUFReader

from moebus.engine.loader.gguf_cache import quantized_blocks
from moebus.engine.models import load_model
from moebus.engine.models.moe import MoE
from moebus.engine.quant_linear import QuantLinear
from moebus.kernels.qmoe import available
from moebus.loadtest.kquant_file import more_bits, rewrite
from moebus.loadtest.llamacpp_convert import convert

from .paged_steps import caches, prompt, run
from .test_moe_quantized import _tiny

pytestmark = [pytest.mark.skipif(not available(), reason="no C compiler"), pytest.mark.slow]



@pytest.fixture(scope="module")
def q8_0_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kquant")
    hf = _tiny("qwen3_moe", root / "hf", hidden_size=256, intermediate_size=256, moe_intermediate_size=256)
    return convert(hf, root / "q8_0.gguf", "q8_0")


@pytest.fixture(scope="module")
def q4_k_gguf(q8_0_gguf: Path) -> Path:
    return rewrite(q8_0_gguf, q8_0_gguf.with_name("q4_k.gguf"))


@pytest.fixture(scope="module")
def q4_k_m_gguf(q8_0_gguf: Path) -> Path:
    return rewrite(q8_0_gguf, q8_0_gguf.with_name("q4_k_m.gguf"), mix="q4_k_m")


def test_the_file_holds_q4_k_and_its_blocks_are_served_as_q4_1(q4_k_gguf):
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(q4_k_gguf)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K" and types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["blk.0.attn_output.weight"] == "Q8_0"  # rows of 64: not whole super-blocks
    blocks = quantized_blocks(q4_k_gguf)
    assert blocks["model.layers.0.self_attn.q_proj.weight"][0] == "Q4_1"
    assert blocks["model.layers.0.self_attn.o_proj.weight"][0] == "Q8_0"


def test_served_on_its_blocks_it_is_closer_to_the_file_than_bf16(q4_k_gguf):
    """The rewrite rounds each sub-block's two scales to f16 (loader/kquants.py) and the blocks' path
    its activations to int16: together they move the logits less than rounding the same weights to
    bf16 does (the MoE families' default serves them dense in bf16), and keep every greedy token. This
    random tiny model amplifies any change of its weights (logits ~8 wide): the Q8_0 file's blocks
    move them 1.3e-3."""
    ours, ref = load_model(q4_k_gguf, weight_format="gguf").model, load_model(q4_k_gguf).model
    rounded = load_model(q4_k_gguf).model
    with torch.no_grad():
        for w in rounded.parameters():
            w.copy_(w.bfloat16().float())
    moes = [m for m in ours.modules() if isinstance(m, MoE)]
    assert moes and all(m.quant_experts is not None and m.w13.numel() == 0 for m in moes)
    assert all(isinstance(ly.self_attn.qkv_proj, QuantLinear) for ly in ours.layers)
    ids = prompt(40, seed=1, vocab=49152)
    want = run(ref, ids, [0], [40], caches(ref, 1))
    got = run(ours, ids, [0], [40], caches(ours, 1))
    half = run(rounded, ids, [0], [40], caches(rounded, 1))
    diff, bf16_diff = (got - want).abs().max().item(), (half - want).abs().max().item()
    print(f"max abs logit diff: blocks {diff:.3e}, weights rounded to bf16 {bf16_diff:.3e} "
          f"(logits up to {want.abs().max():.2f})")
    assert diff < bf16_diff
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_q4_k_m_file_is_served_on_its_blocks_with_its_q6_k_parts_as_q8_0(q4_k_m_gguf):
    """The Q4_K_M mix: attn_v and the down experts in Q6_K in the layers llama-quantize gives more
    bits, the embedding too. Served: every layer's experts on blocks (those layers: gate|up as Q4_1,
    down as Q8_0, in one kernel), every attention projection on blocks (those layers' q, k, v joined as
    Q8_0), the tied head on the embedding's Q8_0."""
    reader = GGUFReader(str(q4_k_m_gguf))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    n = int(reader.fields["qwen3moe.block_count"].contents())
    six = [i for i in range(n) if types[f"blk.{i}.ffn_down_exps.weight"] == "Q6_K"]
    assert six == [i for i in range(n) if more_bits(i, n)] and 0 < len(six) < n
    assert all(types[f"blk.{i}.attn_v.weight"] == ("Q6_K" if i in six else "Q4_K") for i in range(n))
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K" and types["token_embd.weight"] == "Q6_K"
    ours, ref = load_model(q4_k_m_gguf, weight_format="gguf").model, load_model(q4_k_m_gguf).model
    moes = [ly.mlp for ly in ours.layers]
    assert all(isinstance(m, MoE) and m.w13.numel() == 0 for m in moes)
    assert [(m.quant_experts.qtype, m.quant_experts.qtype2) for m in moes] == [
        ("Q4_1", "Q8_0" if i in six else "Q4_1") for i in range(n)]
    qkv = [ly.self_attn.qkv_proj for ly in ours.layers]
    assert all(isinstance(m, QuantLinear) for m in qkv)
    assert [m.qtype for m in qkv] == ["Q8_0" if i in six else "Q4_1" for i in range(n)]
    assert isinstance(ours.lm_head, QuantLinear) and ours.lm_head.qtype == "Q8_0"
    # Against the file dequantized: the Q8_0 re-quantization of the Q6_K parts (1/254 of a block's
    # largest weight at most) on top of what the Q4_K file's blocks move (3.7e-2 above). This random
    # model is chaotic (rounding one norm's gain to bf16 moves its logits by up to 3), so the bound is
    # on the logits' scale: measured 6.3e-2 at logits up to 8.7, and the same greedy tokens.
    ids = prompt(40, seed=2, vocab=49152)
    want = run(ref, ids, [0], [40], caches(ref, 1))
    got = run(ours, ids, [0], [40], caches(ours, 1))
    diff = (got - want).abs().max().item()
    print(f"max abs logit diff: blocks {diff:.3e} (logits up to {want.abs().max():.2f})")
    assert diff < 0.015 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
