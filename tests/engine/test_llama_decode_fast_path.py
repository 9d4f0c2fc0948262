"""The llama batch-1 decode fast path (platforms/cpu/decode_fast_path.py: the whole stack in one C call)
against the module path it replaces, on SmolLM2: the GGUF's Q4_1 layers on 16-bit, 8-bit and float
activations, a mix of Q4_0 / Q4_1 / Q8_0 layers, the dense float32 model and the bf16 one (the
module path's bits: batch invariance by default holds for a lone request); logits of every
decode position of a 38-token prompt (positions cross the 16-token cache blocks) and greedy output
through the engine. Steps it must not take (a batch, a hook) go to the module path."""
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from moebus.engine.attention import AttentionMetadata
from moebus.engine.llm import LLM
from moebus.engine.model_runner import allocate_kv_caches
from moebus.engine.quant_linear import QuantLinear
from moebus.engine.sampling import SamplingParams
from moebus.kernels.decode_stack import DecodeStack, bf16_available, cpu_kernel_available
from moebus.kernels.quant_matmul import dequantize_ref
from moebus.platforms.cpu.packed_linear import panels_wanted

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")
pytestmark = [pytestmark, pytest.mark.slow]  # the slow tier: ./run test-slow

# Both paths run the same GEMV kernels on the same weights; attention, norms and SiLU sum in other
# orders (~1e-6 a layer): float activations measured max 1.0e-4 over the 38 positions. With integer
# activations a reordered input moves some elements' rounding by one step (d = max|x| / 32767 of
# their block at 16 bits): measured 2e-3-9.6e-3 a position, the size of the 16-bit activations' own
# gap to the dense model (test_quantized_weights: 0.010-0.011), so the same bound. 8 bits: measured
# 1.67, as their own gap to the dense model (1.6-2.2): asserted loosely, argmax not at all.
ATOL = {None: 1e-3, 16: 0.05, 8: 5.0}


@pytest.fixture(scope="module")
def gguf_llm(smol_dir) -> LLM:
    return LLM(max_num_batched_tokens=512, weight_format="gguf")


@pytest.fixture
def steps(monkeypatch) -> list[int]:
    """Counts the fast path's C steps."""
    calls: list[int] = []
    real = DecodeStack.step_ids

    def counted(self, *args, **kw):
        calls.append(1)
        return real(self, *args, **kw)

    monkeypatch.setattr(DecodeStack, "step_ids", counted)
    return calls


def _decode_logits(llm: LLM, ids: list[int], fast: bool) -> torch.Tensor:
    """Logits of every position, one token a forward (the decode steps of a batch of one)."""
    model, bs = llm.engine.model, llm.engine.config.block_size
    saved = model.decode_fast_path
    if not fast:
        model.decode_fast_path = None
    dtype = model.embed_tokens.weight.dtype  # the model's: bf16 caches for a bf16 model
    caches = allocate_kv_caches(model.kv_cache_specs(), 8, bs, dtype, torch.device("cpu"))
    table = torch.tensor([[3, 0, 5, 1, 7, 2, 4, 6]], dtype=torch.int32)  # scattered pages
    rows = []
    try:
        with torch.inference_mode():
            for p, tok in enumerate(ids):
                slot = int(table[0, p // bs]) * bs + p % bs
                meta = AttentionMetadata([0, 1], [p + 1], torch.tensor([slot]), table,
                                         torch.tensor([p + 1], dtype=torch.int32), bs)
                rows.append(model.compute_logits(model(torch.tensor([tok]), torch.tensor([p]), meta, caches)))
    finally:
        model.decode_fast_path = saved
    return torch.cat(rows)


def _check(llm: LLM, ids: list[int], atol: float, steps: list[int], same_argmax: bool = True) -> float:
    ref = _decode_logits(llm, ids, fast=False)
    assert not steps
    fast = _decode_logits(llm, ids, fast=True)
    assert len(steps) == len(ids)  # every step took the fast path
    diff = (fast - ref).abs().max().item()
    assert diff < atol, diff
    if same_argmax:
        assert torch.equal(fast.argmax(-1), ref.argmax(-1))
    assert ref.abs().max() > 5  # real logits
    return diff


def _set_bits(llm: LLM, bits: int | None) -> None:
    for m in llm.engine.model.modules():
        if isinstance(m, QuantLinear):
            m.activation_bits = bits


@pytest.mark.parametrize("bits", [16, None, 8])
def test_gguf_logits_match_the_module_path(gguf_llm, chat_prompts, steps, bits):
    try:
        _set_bits(gguf_llm, bits)  # the plan follows the change: its state includes the widths
        diff = _check(gguf_llm, chat_prompts[1], ATOL[bits], steps, same_argmax=bits != 8)
    finally:
        _set_bits(gguf_llm, 16)
    print(f"activation bits {bits}: max abs logit diff fast vs module path {diff:.2e}")


def test_dense_logits_match_the_module_path(llm, chat_prompts, steps):
    print(f"float32: max abs logit diff {_check(llm, chat_prompts[1], ATOL[None], steps):.2e}")


@pytest.mark.skipif(not (bf16_available() and panels_wanted(torch.bfloat16)),
                    reason="needs AVX512-BF16 without AMX (the bf16 panel kernels)")
def test_bf16_logits_are_the_module_path_bits(smol_dir, chat_prompts, steps):
    bf16 = LLM(max_num_batched_tokens=512, dtype="bfloat16", weight_format="dense")
    ids = chat_prompts[1]
    ref = _decode_logits(bf16, ids, fast=False)
    fast = _decode_logits(bf16, ids, fast=True)
    assert len(steps) == len(ids) and ref.abs().max() > 5  # every step took the fast path; real logits
    assert torch.equal(fast, ref), (fast - ref).abs().max().item()


def _requantized(m: QuantLinear, qtype: str) -> QuantLinear:
    w = dequantize_ref(m.qweight, m.qtype, m.in_features)
    return QuantLinear(torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[qtype])), qtype, m.in_features)


def test_mixed_block_types_match_the_module_path(gguf_llm, chat_prompts, steps):
    layers = gguf_llm.engine.model.layers
    saved = [(ly.self_attn.qkv_proj, ly.mlp.down_proj) for ly in layers]
    try:
        for ly in layers:  # the plan sees new modules and rebuilds
            ly.self_attn.qkv_proj = _requantized(ly.self_attn.qkv_proj, "Q8_0")
            ly.mlp.down_proj = _requantized(ly.mlp.down_proj, "Q4_0")
        _check(gguf_llm, chat_prompts[1][:20], ATOL[16], steps)
    finally:
        for ly, (qkv, down) in zip(layers, saved, strict=True):
            ly.self_attn.qkv_proj, ly.mlp.down_proj = qkv, down


def test_a_new_embedding_weight_rebuilds_the_plan(gguf_llm, chat_prompts, steps):
    emb = gguf_llm.engine.model.embed_tokens
    saved = emb.weight
    _decode_logits(gguf_llm, chat_prompts[1][:2], fast=True)  # a plan on the old weight
    steps.clear()
    try:
        emb.weight = torch.nn.Parameter(saved.detach().roll(1, 0), requires_grad=False)  # other rows
        _check(gguf_llm, chat_prompts[1][:8], ATOL[16], steps)
    finally:
        emb.weight = saved


def test_greedy_output_identical_through_the_engine(gguf_llm, chat_prompts, steps):
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    model = gguf_llm.engine.model
    saved, model.decode_fast_path = model.decode_fast_path, None
    try:
        ref = [gguf_llm.generate([p], params)[0].outputs[0].token_ids for p in chat_prompts]
    finally:
        model.decode_fast_path = saved
    assert not steps
    assert [gguf_llm.generate([p], params)[0].outputs[0].token_ids for p in chat_prompts] == ref
    assert len(steps) == len(chat_prompts) * 23  # every decode step of a batch of one


def test_batches_and_hooks_take_the_module_path(gguf_llm, chat_prompts, steps):
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    gguf_llm.generate(chat_prompts[:2], params)  # two sequences a step
    assert not steps
    seen = []
    hook = gguf_llm.engine.model.layers[3].mlp.register_forward_hook(lambda *a: seen.append(1))
    try:
        gguf_llm.generate(chat_prompts[:1], params)
    finally:
        hook.remove()
    assert not steps and len(seen) == 4  # prefill + 3 decode steps, all through the modules
    gguf_llm.generate(chat_prompts[:1], params)
    assert len(steps) == 3
