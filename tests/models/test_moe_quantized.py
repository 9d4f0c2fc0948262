"""weight_format "gguf" on the MoE families (the decoders and DeepSeek-V2/V3's MLA): a Q8_0 GGUF written by llama.cpp's own converter
served on its blocks (experts on kernels/qmoe.py's panels, attention and head on QuantLinear)
against the same file dequantized to float32. The weights are the same numbers; the blocks' path
quantizes activations to int16 blocks, so logits move by that rounding only (QUANT_LOGIT_ATOL),
greedy tokens are the same, a request's logprobs are the same bits alone and batched through the
modules, and the decoders' batch-1 C step (platforms/cpu/moe_decode.py) gives the same tokens."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moebus.engine.llm import LLM
from moebus.engine.loader.gguf_cache import converted_dir
from moebus.engine.models import load_model
from moebus.engine.models.moe import MoE
from moebus.engine.models.tiny_checkpoints import write_tiny
from moebus.engine.quant_linear import QuantLinear
from moebus.engine.sampling import SamplingParams
from moebus.kernels.qmoe import available
from moebus.loadtest.llamacpp_convert import convert
from moebus.platforms.format_choice import choose_format
from moebus.text.gguf import embedded_gguf_path

from .paged_steps import caches, prompt, run

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler")
pytestmark = [pytestmark, pytest.mark.slow]  # the slow tier: ./run test-slow

# int16 activation blocks (rounding <= max|x| / 65534 an element) through 3 tiny layers; the
# logits here are O(1): measured max 1.1e-4 over these families
QUANT_LOGIT_ATOL = 2e-3
# as llama.cpp's converter needs them (test_moe_families_gguf.py says why)
_GGUF_SAFE = {"qwen3_moe": {"mlp_only_layers": []}, "olmoe": {"clip_qkv": None, "rms_norm_eps": 1e-5},
              "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}
MLA = ("deepseek_v2", "deepseek_v3")
FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "granite_moe", *MLA)
# The compared prompt: under seed 1 one of tiny V2's tokens sits at a near tie of its group-limited
# routing (a 2.5e-5 change of its router weights picks another expert): that is quantization
# moving a choice, not a wrong kernel, so the MLA families are compared on a prompt without one.
PROMPT_SEED = {"deepseek_v2": 2, "deepseek_v3": 2}


def _tiny(family: str, out: Path, **overrides: object) -> Path:
    hf = write_tiny(family, out, seed=0, vocab_size=49152, **{**_GGUF_SAFE.get(family, {}), **overrides})
    src = converted_dir(embedded_gguf_path())
    shutil.copy(src / "tokenizer.json", hf / "tokenizer.json")
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (hf / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return hf


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def q8_gguf(family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = _tiny(family, tmp_path_factory.mktemp(family))
    return convert(hf, tmp_path_factory.mktemp("gguf") / "model-q8_0.gguf", "q8_0")


def _linears_on_blocks(family: str, layer) -> list:
    """The layer's linear layers the file holds whole in Q8_0: the attention's projections (MLA's
    kv_b_proj comes as per-head 3-D tensors and stays dense), a dense layer's MLP, the shared experts."""
    attn = layer.self_attn
    if family not in MLA:
        return [attn.qkv_proj, attn.o_proj]
    out = [attn.q_a_proj if attn.q_lora else attn.q_proj, attn.kv_a_proj_with_mqa, attn.o_proj]
    return [*out, *layer.mlp.shared_experts.blocks] if layer.is_moe else [*out, layer.mlp.gate_up_proj,
                                                                          layer.mlp.down_proj]


def test_the_blocks_are_served_and_match_the_dequantized_model(family, q8_gguf):
    ours, ref = load_model(q8_gguf, weight_format="gguf").model, load_model(q8_gguf).model
    moes = [m for m in ours.modules() if isinstance(m, MoE)]
    assert moes and all(m.quant_experts is not None and m.w13.numel() == 0 for m in moes)  # no dense copy
    assert all(m.shared_experts.gate_up_proj.numel() == 0 for m in moes if m.shared_experts is not None)
    assert all(isinstance(lin, QuantLinear) for ly in ours.layers for lin in _linears_on_blocks(family, ly))
    assert isinstance(ours.lm_head, QuantLinear)
    ids = prompt(40, seed=PROMPT_SEED.get(family, 1), vocab=49152)
    got, want = run(ours, ids, [0], [40], caches(ours, 1)), run(ref, ids, [0], [40], caches(ref, 1))
    diff = (got - want).abs().max().item()
    print(f"max abs logit diff {diff:.3e} (logits up to {want.abs().max().item():.2f})")
    assert diff < QUANT_LOGIT_ATOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_tokens_equal_and_batch_invariant(family, q8_gguf):
    """Through the modules a request's logprobs are the same bits alone and batched; the decoders'
    batch-1 C step (platforms/cpu/moe_decode.py) gives its tokens, and its logprobs to float32
    rounding. MLA has no C step, and keeps dense parts (shared experts, kv_b_proj, router) that are
    batch invariant in deterministic mode only (engine/batch_invariant.py): it runs in that mode."""
    ps = [prompt(n, seed=n, vocab=49152).tolist() for n in (9, 33, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    gguf = LLM(str(q8_gguf), num_kv_blocks=32, weight_format="gguf", deterministic=family in MLA)
    model = gguf.engine.model
    fast = gguf.generate([ps[0]], params)[0].outputs[0]
    if family in MLA:
        assert getattr(model, "decode_fast_path", None) is None
    else:
        assert model.decode_fast_path._plan is not None  # the C step ran
    hook = model.norm.register_forward_hook(lambda *a: None)  # a hook: the module path
    try:
        alone = gguf.generate([ps[0]], params)[0].outputs[0]
        together = gguf.generate(ps, params)
    finally:
        hook.remove()
    dense = LLM(str(q8_gguf), num_kv_blocks=32).generate(ps, params)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in dense]
    assert together[0].outputs[0].token_ids == alone.token_ids == fast.token_ids
    assert together[0].outputs[0].logprobs == alone.logprobs  # bit for bit, every step
    for a, b in zip(fast.logprobs, alone.logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)


def test_expert_parallelism_refuses_quantized_experts(q8_gguf):
    from moebus.engine.distributed.ep_moe import EPMoE

    moe = next(m for m in load_model(q8_gguf, weight_format="gguf").model.modules() if isinstance(m, MoE))
    with pytest.raises(ValueError, match="weight_format 'dense'"):
        EPMoE(moe, placement=None, group=None)


ZEN4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}


def test_auto_keeps_an_moe_gguf_dense_and_gguf_serves_its_blocks_when_asked(tmp_path):
    """weight_format auto (platforms/format_choice.py): an MoE GGUF in Q8_0 stays dense (its blocks
    are a latency choice), and so does a bf16 GGUF, which has no blocks to serve; asked for, gguf."""
    hf = _tiny("granite_moe", tmp_path / "hf")
    q8, bf16 = convert(hf, tmp_path / "q8_0.gguf", "q8_0"), convert(hf, tmp_path / "bf16.gguf", "bf16")
    c = choose_format(q8, "auto", "auto", flags=ZEN4)
    assert (c.weight_format, c.dtype) == ("dense", "auto") and "latency choice" in c.reason, c
    assert choose_format(q8, "gguf", "float32", flags=ZEN4).weight_format == "gguf"
    c = choose_format(bf16, "auto", "auto", flags=ZEN4)
    assert (c.weight_format, c.dtype) == ("dense", "auto") and "0% of the GGUF's weights" in c.reason, c
