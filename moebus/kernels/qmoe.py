"""Mixture-of-experts MLP on GGUF-quantized experts (Q4_0, Q4_1, Q8_0), float32 activations:
out[t] = sum_j w[t, j] * W2[e] @ swiglu(W13[e] @ x[t]), e = ids[t, j], each product on 16-bit
integer activations as kernels/qpanel.py's linear layer takes them.

Why: at batch 1 an MoE step reads every active expert's weights once; a Q8_0 expert is ~1.06
bytes a weight against bf16's 2 and Q4 ~0.56, and the panels' integer dots keep the step at the
memory bound. In a batch each active expert runs one GEMM over all of its tokens on the same
panels, and qpanel.h's one formula makes a token's result the same bits at any batch.

Weights: each expert's GGUF rows (w13 [E, 2I, D / 32 * block bytes], gate rows then up rows;
w2 [E, D, I / 32 * block bytes]) packed by `pack_experts` into panels, experts back to back; the
layer keeps only the panels. `qtype` is gate|up's type and `qtype2` down's (None: the same; a Q4_K_M
file's down experts are Q6_K, served as Q8_0 beside its Q4_K gate/up served as Q4_1).
`qmoe_ref` is the spec, on the rows: quant_matmul_qa_ref at 16 bits per expert (float64 block sums:
the kernel's float32 sums differ by rounding).
"""
from __future__ import annotations

import torch

from .cpu_build import F32, I32, I64, PTR, library
from .qpanel import pack_panels, panel_bytes
from .quant_matmul import GGML_TYPES, QK, quant_matmul_qa_ref
from .silu_mul import silu_and_mul_ref

_SOURCE = "qmoe_cpu.c"
_ARGS = [I32, I32, PTR, I64, PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32, I32, F32]


def shapes_ok(hidden: int, intermediate: int) -> bool:
    """The kernel's shapes: both inner dimensions whole GGUF blocks of 32."""
    return hidden % QK == 0 and intermediate % QK == 0


def qmoe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, qtype: str, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, swiglu_limit: float | None = None, qtype2: str | None = None) -> torch.Tensor:
    """float32 x [T, D] on the experts' GGUF rows -> float32 [T, D] (module docstring)."""
    t, k = topk_ids.shape
    d = x.shape[1]
    out = torch.zeros(t, d, dtype=torch.float64)
    for e in topk_ids.unique().tolist():
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)
        h = quant_matmul_qa_ref(x[rows].float(), w13[e], qtype, 16)
        y = quant_matmul_qa_ref(silu_and_mul_ref(h, limit=swiglu_limit), w2[e], qtype2 or qtype, 16)
        out.index_add_(0, rows, topk_weights[rows, slots].double()[:, None] * y.double())
    return out.float()


def pack_experts(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor | None:
    """GGUF rows uint8 [E, N, K / 32 * block bytes] -> uint8 [E, panel_bytes(qtype, N, K)] (each
    expert's panels), or None without the C library."""
    packed = [pack_panels(w[e], qtype, k) for e in range(w.shape[0])]
    return None if any(p is None for p in packed) else torch.stack(packed)


def available() -> bool:
    return library(_SOURCE).get() is not None


def qmoe_cpu(x: torch.Tensor, p13: torch.Tensor, p2: torch.Tensor, qtype: str, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, intermediate: int, swiglu_limit: float | None = None,
             lib: object | None = None, qtype2: str | None = None) -> torch.Tensor | None:
    """csrc/qmoe_cpu.c on pack_experts' panels: float32 [T, D], or None without the C library.
    lib: a build of qmoe_cpu.c (tests pass cpu_build.build_variant's)."""
    t, k = topk_ids.shape
    e, d = p13.shape[0], x.shape[1]
    assert x.dim() == 2 and x.device.type == "cpu" and shapes_ok(d, intermediate), (x.shape, intermediate)
    assert p13.shape == (e, panel_bytes(qtype, 2 * intermediate, d)), p13.shape
    qtype2 = qtype2 or qtype
    assert p2.shape == (e, panel_bytes(qtype2, d, intermediate)), p2.shape
    if t == 0:
        return torch.zeros(0, d)
    if lib is None:
        fn = library(_SOURCE).entry("qmoe_f32", _ARGS)
    else:
        fn = lib.qmoe_f32
        fn.argtypes, fn.restype = _ARGS, I32
    if fn is None:
        return None
    x = x.float()
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(t, d)
    status = fn(GGML_TYPES[qtype], GGML_TYPES[qtype2], x.data_ptr(), x.stride(0), p13.data_ptr(), p2.data_ptr(), weights.data_ptr(),
                ids.data_ptr(), out.data_ptr(), t, k, e, d, intermediate, swiglu_limit is not None,
                0.0 if swiglu_limit is None else float(swiglu_limit))
    if status == 2:
        raise IndexError(f"an expert id outside [0, {e})")
    return out if status == 0 else None
