"""Kernels: each op is one module with a torch reference `<op>_ref`, a Triton kernel `<op>_triton`
and a dispatcher `<op>` that runs Triton on CUDA tensors (when triton imports) and the torch
reference everywhere else. The references are vectorized: they are the production CPU path.

| module | ops |
| --- | --- |
| rmsnorm.py | `rms_norm(x, weight, eps)`, `fused_add_rms_norm(x, residual, weight, eps) -> (normed, x + residual)` |
| rotary.py | `apply_rotary(q, k, cos, sin) -> (q, k)` (neox, partial rotary), `rotary_cos_sin(positions, R, base, dtype)` |
| silu_mul.py | `silu_and_mul(x, *, limit=None)`: `[..., 2I] -> [..., I]` |
| paged_attention.py | `paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, sinks)` |
| prefill_attention.py | `prefill_attention(q, k_cache, v_cache, block_tables, q_start, q_len, seq_lens, scale, sliding_window, sinks, out)`: causal prefill of many sequences over the paged cache; C kernel on CPU (AMX for bf16), per-sequence SDPA elsewhere |
| fused_moe.py | `fused_moe(x, w13, w2, topk_weights, topk_ids, swiglu_limit=None)`; `moe_align` (token grouping); C kernel for <= 256 tokens |
| argmax.py | `row_argmax(x[B, N]) -> [B]` int64 (first maximum, NaN wins: torch's `max(dim=1).indices`) |
| sample.py | `sample_logits(x[B, V], temperature[B], u[B], floor=None) -> [B]` int64: a draw from softmax(x / T) over the logits >= floor, by inverse CDF at the caller's uniform u (T <= 0: argmax); C kernel on CPU, no Triton twin |
| lm_head_argmax.py | `lm_head_argmax(x[M, K], w[N, K], panels=None) -> [M]` int64: greedy tokens from the LM head without the logits; `lm_head_logits(...) -> [M, N]` float32 logits from weights in any dtype, never rounded to it (`pack_panels(w)`: the C kernel's weight layout) |
| quant_matmul.py | `quant_matmul(x[M, K], w, qtype) -> [M, N]`: GGUF Q4_0/Q4_1/Q8_0 blocks `w` (uint8 [N, K/32 * block bytes]) dequantized inside the GEMV/GEMM; C kernel on CPU |
| mhc.py | `hc_mix(mix, base, scale, n, iters, eps) -> (pre, post, comb)` (mHC gates + Sinkhorn mixture), `hc_merge(streams, block_out, post, comb)`, `hc_pre(streams, fn, base, scale, n, iters, hc_eps, norm_eps)` (the whole pre-block: a C kernel on CPU, no Triton twin; elsewhere the reference, its GEMM on the tensor cores and its mixing in `hc_mix`) |
| compressor.py | `compress_windows(kv, gate, bias) -> [N, C]` (DeepSeek-V4 KV compressor: softmax-gated pooling of each window's slots) |
| indexer_topk.py | `indexer_topk(q, weights, keys, start, n_visible, k, scale) -> [R, k]` (DeepSeek-V4 lightning indexer; Triton scores + torch's sort, C scores + heap) |

Tests (tests/kernels) run the Triton kernels on CPU under TRITON_INTERPRET=1 against the
references, and the references against float64 loops.
"""
from ._compat import HAS_TRITON
from .argmax import row_argmax, row_argmax_ref, row_argmax_triton
from .fused_moe import fused_moe, fused_moe_ref, fused_moe_triton, moe_align
from .lm_head_argmax import (
    lm_head_argmax,
    lm_head_argmax_ref,
    lm_head_argmax_triton,
    lm_head_logits,
    lm_head_logits_ref,
    pack_panels,
)
from .mhc import (
    hc_merge,
    hc_merge_ref,
    hc_merge_triton,
    hc_mix,
    hc_mix_ref,
    hc_mix_triton,
    hc_pre,
    hc_pre_ref,
)
from .paged_attention import paged_attention_decode, paged_attention_decode_ref, paged_attention_decode_triton
from .quant_matmul import quant_matmul, quant_matmul_ref, quant_matmul_triton
from .rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
)
from .rotary import apply_rotary, apply_rotary_ref, apply_rotary_triton, rotary_cos_sin
from .sample import sample_logits, sample_logits_ref
from .silu_mul import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton

__all__ = [
    "HAS_TRITON",
    "row_argmax", "row_argmax_ref", "row_argmax_triton",
    "apply_rotary", "apply_rotary_ref", "apply_rotary_triton", "rotary_cos_sin",
    "fused_add_rms_norm", "fused_add_rms_norm_ref", "fused_add_rms_norm_triton",
    "fused_moe", "fused_moe_ref", "fused_moe_triton", "moe_align",
    "lm_head_argmax", "lm_head_argmax_ref", "lm_head_argmax_triton", "lm_head_logits", "lm_head_logits_ref",
    "pack_panels",
    "hc_merge", "hc_merge_ref", "hc_merge_triton", "hc_mix", "hc_mix_ref", "hc_mix_triton", "hc_pre", "hc_pre_ref",
    "paged_attention_decode", "paged_attention_decode_ref", "paged_attention_decode_triton",
    "quant_matmul", "quant_matmul_ref", "quant_matmul_triton",
    "rms_norm", "rms_norm_ref", "rms_norm_triton",
    "sample_logits", "sample_logits_ref",
    "silu_and_mul", "silu_and_mul_ref", "silu_and_mul_triton",
]
