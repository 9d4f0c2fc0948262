"""weight_format="gguf": SmolLM2's Q4_1 linear layers and its Q8_0 tied LM head served from the GGUF's
blocks (engine.quant_linear.QuantLinear) against the same model dequantized to float32. The weights
are the same numbers, so only summation order differs: logits within LOGIT_ATOL and greedy output
identical on the parity prompts. Decode steps (1-3 rows a QuantLinear call; on AVX-512 every row
count, through the panels) quantize the activation to int16 blocks by default (activation_bits=16,
Q4 layers and the Q8_0 head): those logits move by the activation's rounding, within
DECODE_LOGIT_ATOL, and greedy output must still be identical; with activation_bits None they are
back within LOGIT_ATOL."""
import pytest
import torch

from moebus.engine.attention import AttentionMetadata
from moebus.engine.llm import LLM
from moebus.engine.model_runner import allocate_kv_caches
from moebus.engine.models import load_model
from moebus.engine.quant_linear import QuantLinear
from moebus.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

# Largest |logit| of SmolLM2 on these prompts is ~30; float32 sums over K <= 1536 in two orders
# differ by ~1e-5 per layer and that grows through 30 layers: measured max 1.2e-4 (Zen 3, AVX2).
LOGIT_ATOL = 1e-3
# 16-bit activations (per block of 32: rounding error up to max|x| / 65534 an element) through 30
# layers: measured max 0.010-0.011 over the 38 decode positions of chat_prompts[1] (8 bits: 1.6-2.2).
DECODE_LOGIT_ATOL = 0.05


@pytest.fixture(scope="module")
def gguf_llm(smol_dir) -> LLM:
    return LLM(max_num_batched_tokens=512, weight_format="gguf")


@pytest.fixture(scope="module")
def dense_llm(llm) -> LLM:
    assert llm.engine.config.weight_format == "dense"  # the default
    return llm


def _all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    eng = llm.engine
    bs = eng.config.block_size
    caches = allocate_kv_caches(eng.model.kv_cache_specs(), 8, bs, torch.float32, torch.device("cpu"))
    blocks = list(range(-(-len(ids) // bs)))
    meta = AttentionMetadata([0, len(ids)], [len(ids)],
                             torch.tensor([blocks[p // bs] * bs + p % bs for p in range(len(ids))]),
                             torch.tensor([blocks], dtype=torch.int32), torch.tensor([len(ids)], dtype=torch.int32), bs)
    with torch.no_grad():
        return eng.model.compute_logits(eng.model(torch.tensor(ids), torch.arange(len(ids)), meta, caches))


def _decode_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits of every position with one token a forward (decode steps: 1-row linear calls)."""
    eng = llm.engine
    bs = eng.config.block_size
    caches = allocate_kv_caches(eng.model.kv_cache_specs(), 8, bs, torch.float32, torch.device("cpu"))
    table = torch.tensor([list(range(-(-len(ids) // bs)))], dtype=torch.int32)
    rows = []
    with torch.no_grad():
        for p, tok in enumerate(ids):
            meta = AttentionMetadata([0, 1], [p + 1], torch.tensor([p]), table,
                                     torch.tensor([p + 1], dtype=torch.int32), bs)
            rows.append(eng.model.compute_logits(eng.model(torch.tensor([tok]), torch.tensor([p]), meta, caches)))
    return torch.cat(rows)


def _set_bits(llm: LLM, bits: int | None) -> None:
    for m in llm.engine.model.modules():
        if isinstance(m, QuantLinear):
            m.activation_bits = bits


def test_decode_logits_with_integer_activations(gguf_llm, dense_llm, chat_prompts):
    ids = chat_prompts[1]
    ref = _decode_logits(dense_llm, ids)
    assert all(m.activation_bits == 16 for m in gguf_llm.engine.model.modules() if isinstance(m, QuantLinear))
    diffs = {}
    try:
        for bits in (16, 8, None):
            _set_bits(gguf_llm, bits)
            logits = _decode_logits(gguf_llm, ids)
            diffs[bits] = (logits - ref).abs().max().item()
            if bits != 8:  # 8 bits (llama.cpp's activations) flip near ties: measured, not asserted
                assert torch.equal(logits.argmax(-1), ref.argmax(-1)), bits
    finally:
        _set_bits(gguf_llm, 16)
    print(f"max abs decode logit diff vs dense over {len(ids)} positions, by activation bits: {diffs}")
    assert diffs[16] < DECODE_LOGIT_ATOL and diffs[None] < LOGIT_ATOL
    assert diffs[8] > diffs[16] > diffs[None]  # each width really ran


def test_gguf_format_serves_the_blocks(gguf_llm, dense_llm):
    model = gguf_llm.engine.model
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.qtype == "Q4_1"
    assert isinstance(layer.mlp.down_proj, QuantLinear) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.qtype == "Q8_0"  # the tied head runs on the embedding's own blocks
    assert model.lm_head.activation_bits == 16
    linear_bytes = sum(m.qweight.numel() for m in model.modules() if isinstance(m, QuantLinear))
    dense_bytes = sum(p.numel() * 4 for n, p in dense_llm.engine.model.named_parameters() if "norm" not in n)
    assert linear_bytes < dense_bytes / 5  # ~96 MB of blocks vs ~540 MB of float32


def test_logits_match_the_dequantized_model(gguf_llm, dense_llm, chat_prompts):
    """A prompt's rows in one call: on AVX-512 the panels (kernels/qpanel.py) take every row count
    on 16-bit activations, so prefill logits move by their rounding as decode's do; float
    activations are back within LOGIT_ATOL."""
    ids = chat_prompts[1]
    ref = _all_logits(dense_llm, ids)
    panels = any(m.uses_panels() for m in gguf_llm.engine.model.modules() if isinstance(m, QuantLinear))
    try:
        diffs = {}
        for bits in (16, None):
            _set_bits(gguf_llm, bits)
            ours = _all_logits(gguf_llm, ids)
            diffs[bits] = (ours - ref).abs().max().item()
            assert ours.abs().max() > 5  # real logits, not zeros
    finally:
        _set_bits(gguf_llm, 16)
    print(f"max abs logit diff gguf vs dense over {len(ids)} positions, by activation bits: {diffs} (panels: {panels})")
    assert diffs[None] < LOGIT_ATOL
    assert diffs[16] < (DECODE_LOGIT_ATOL if panels else LOGIT_ATOL)


def test_greedy_output_identical_to_the_dequantized_model(gguf_llm, dense_llm, chat_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    ours = [o.outputs[0].token_ids for o in gguf_llm.generate(chat_prompts, params)]
    ref = [o.outputs[0].token_ids for o in dense_llm.generate(chat_prompts, params)]
    assert ours == ref
    # batch 1: every decode step on 1-row calls, the 16-bit activation kernel (the batch above
    # prefills on the tiled float one; its 4-row decode steps take the direct float path)
    for i, prompt in enumerate(chat_prompts):
        assert gguf_llm.generate([prompt], params)[0].outputs[0].token_ids == ref[i], i


def test_raw_greedy_steps_skip_the_sampler(gguf_llm, dense_llm, chat_prompts):
    """Raw greedy steps take their tokens from the QuantLinear head's fused argmax (QuantLinear.greedy:
    no logits at 1-3 rows), without the sampler (ModelRunner.raw_argmax); the argmax of its logits
    and the sampler give the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)  # min_tokens would ban eos
    runner, head = gguf_llm.engine.runner, gguf_llm.engine.model.lm_head
    assert runner.greedy_head == head.greedy and runner.raw_argmax
    greedy, sampler, calls, fused = runner.greedy_head, runner.sampler, [], []
    runner.sampler = lambda *a: calls.append(1) or sampler(*a)
    runner.greedy_head = lambda rows: fused.append(len(rows)) or greedy(rows)
    try:
        fast = [o.outputs[0].token_ids for o in gguf_llm.generate(chat_prompts[:2], params)]
        assert not calls and fused
        runner.greedy_head = None  # logits, then their argmax
        assert [o.outputs[0].token_ids for o in gguf_llm.generate(chat_prompts[:2], params)] == fast
        runner.raw_argmax = False
        assert [o.outputs[0].token_ids for o in gguf_llm.generate(chat_prompts[:2], params)] == fast
        assert calls
    finally:
        runner.sampler, runner.raw_argmax, runner.greedy_head = sampler, True, greedy
    for prompt in chat_prompts:  # batch 1: 1-row head calls (the C kernel), as the dequantized model
        assert (gguf_llm.generate([prompt], params)[0].outputs[0].token_ids
                == dense_llm.generate([prompt], params)[0].outputs[0].token_ids)


def test_quant_linear_paths_by_shape_and_bits():
    """1-3 row calls take the integer-activation kernel (activation_bits), more rows too where the
    panels run (AVX-512), else the float one; None the float one; a 3-D x gives the rows of its 2-D
    view."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from moebus.kernels.quant_matmul import quant_matmul_qa_ref, quant_matmul_ref

    g = torch.Generator().manual_seed(0)
    w = torch.from_numpy(quantize(torch.randn(40, 96, generator=g).numpy(), GGMLQuantizationType.Q4_1))
    lin, x = QuantLinear(w, "Q4_1", 96), torch.randn(2, 96, generator=g)
    assert lin.activation_bits == 16
    with torch.no_grad():
        torch.testing.assert_close(lin(x), quant_matmul_qa_ref(x, w, "Q4_1", 16), atol=1e-4, rtol=1e-5)
        assert torch.equal(lin(x[None]), lin(x)[None])
        big = torch.randn(5, 96, generator=g)  # above QA_MAX_ROWS: the panels' 16 bits, else float activations
        want = quant_matmul_qa_ref(big, w, "Q4_1", 16) if lin.uses_panels() else quant_matmul_ref(big, w, "Q4_1")
        torch.testing.assert_close(lin(big), want, atol=1e-4, rtol=1e-5)
        assert torch.equal(lin(big)[:2], lin(big[:2])) or not lin.uses_panels()  # one formula, any row count
        lin.activation_bits = 8  # 8 bits: far enough from float to tell which kernel ran
        torch.testing.assert_close(lin(x), quant_matmul_qa_ref(x, w, "Q4_1", 8), atol=1e-4, rtol=1e-5)
        assert (lin(x) - quant_matmul_ref(x, w, "Q4_1")).abs().max() > 1e-3
        lin.activation_bits = None
        torch.testing.assert_close(lin(x), quant_matmul_ref(x, w, "Q4_1"), atol=1e-4, rtol=1e-5)


def test_quant_linear_greedy_is_the_argmax_of_its_logits():
    """QuantLinear.greedy: the C kernel at 1-3 rows (each activation width), the logits' argmax above."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from moebus.kernels.argmax import row_argmax_ref

    g = torch.Generator().manual_seed(1)
    w = torch.from_numpy(quantize(torch.randn(3000, 96, generator=g).numpy(), GGMLQuantizationType.Q8_0))
    lin = QuantLinear(w, "Q8_0", 96)
    with torch.no_grad():
        for bits in (16, 8, None):
            lin.activation_bits = bits
            for rows in (1, 3, 5):
                x = torch.randn(rows, 96, generator=g)
                assert torch.equal(lin.greedy(x), row_argmax_ref(lin(x))), (bits, rows)


def test_q8_0_takes_16_bit_activations():
    """Q8_0 (SmolLM2's tied head) is in QA16_TYPES: its 1-3 row calls take the 16-bit kernel, 15%
    faster a call than the float one on the head's shape (Sapphire Rapids, engine/quant_linear.py)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from moebus.kernels.quant_matmul import qa_cpu_library, quant_matmul_qa_ref, quant_matmul_ref

    if qa_cpu_library() is None:
        pytest.skip("no integer-activation C kernel on this machine")
    g = torch.Generator().manual_seed(1)
    w = torch.from_numpy(quantize(torch.randn(40, 96, generator=g).numpy(), GGMLQuantizationType.Q8_0))
    lin, x = QuantLinear(w, "Q8_0", 96), torch.randn(1, 96, generator=g)
    assert lin.few_rows_activation_bits() == 16
    with torch.no_grad():
        torch.testing.assert_close(lin(x), quant_matmul_qa_ref(x, w, "Q8_0", 16), atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(lin(x), quant_matmul_ref(x, w, "Q8_0"), atol=1e-3, rtol=1e-4)


def test_bad_weight_format_is_refused(smol_dir):
    with pytest.raises(ValueError, match="weight_format"):
        load_model("smollm2", weight_format="int3")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        load_model(smol_dir, weight_format="gguf")


@pytest.mark.parametrize("bits", [8, None])
def test_activation_bits_come_from_the_engine_config(smol_dir, bits):
    from moebus.engine.config import EngineConfig

    loaded = load_model("smollm2", weight_format="gguf", activation_bits=bits)
    quant = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert quant and {m.activation_bits for m in quant} == {bits}
    assert EngineConfig(weight_format="gguf", gguf_activation_bits=bits).gguf_activation_bits == bits
    with pytest.raises(ValueError, match="gguf_activation_bits"):
        EngineConfig(weight_format="gguf", gguf_activation_bits=4)


def test_a_requests_logits_are_the_same_alone_and_batched(gguf_llm, chat_prompts):
    """Where the panels run, one formula serves every row count: a request's logprobs are the same
    bits alone and beside others through the modules. The batch-1 C step (platforms/cpu/decode_fast_path.py) reads
    the same panels but computes norms, rotary and attention in its own order: its tokens agree,
    its logprobs to float32 rounding."""
    if not gguf_llm.engine.model.lm_head.uses_panels():
        pytest.skip("no AVX-512: the GGUF row layout's paths differ by row count")
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
    fast = gguf_llm.generate([chat_prompts[0]], params)[0].outputs[0]
    hook = gguf_llm.engine.model.norm.register_forward_hook(lambda *a: None)  # a hook: the module path
    try:
        alone = gguf_llm.generate([chat_prompts[0]], params)[0].outputs[0]
        together = gguf_llm.generate(chat_prompts, params)[0].outputs[0]
    finally:
        hook.remove()
    assert together.token_ids == alone.token_ids == fast.token_ids
    assert together.logprobs == alone.logprobs  # bit for bit, every step
    for a, b in zip(fast.logprobs, alone.logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)
