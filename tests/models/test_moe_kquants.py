"""A Q4_K GGUF served on its blocks (weight_format "gguf"): its Q4_K tensors rewritten as Q4_1 blocks
at load (loader/kquants.py) run on the same kernels as a Q4_1 file's, its other tensors as they are.
A tiny Qwen3-MoE whose rows are whole Q4_K super-blocks (hidden and expert widths 256), written by
llama.cpp's converter in Q8_0, then its weight matrices re-quantized to Q4_K (loadtest/kquant_file.py),
against the same file dequantized to float32 by gguf-py."""
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
from moebus.loadtest.kquant_file import rewrite
from moebus.loadtest.llamacpp_convert import convert

from .paged_steps import caches, prompt, run
from .test_moe_quantized import _tiny

pytestmark = [pytest.mark.skipif(not available(), reason="no C compiler"), pytest.mark.slow]



@pytest.fixture(scope="module")
def q4_k_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kquant")
    hf = _tiny("qwen3_moe", root / "hf", hidden_size=256, intermediate_size=256, moe_intermediate_size=256)
    return rewrite(convert(hf, root / "q8_0.gguf", "q8_0"), root / "q4_k.gguf")


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
