"""Greedy tokens from a GGUF-block LM head: argmax_n (x . dequantize(w)_n) without the [M, N] logits.

The logits are those of the few-row GEMVs (quant_matmul.py): on `bits` = 8 / 16-bit integer
activations (quant_matmul_qa_ref), or on float ones (bits None: quant_matmul_ref's direct path);
then torch's `max(dim=1).indices`: the first maximum of each row, a row holding a NaN its first
NaN. The C kernel (csrc/quant_argmax_cpu.c) computes each logit with the very loops the GEMV
kernels run, so its tokens equal row_argmax of their logits exactly; against the references here
(float64 sums) only a near-tie can resolve the other way.

Why: at batch 1 the tied Q8_0 head of SmolLM2 (49152 x 576) is the largest GEMV of a decode step;
its logits' write, read-back and separate argmax call were a measurable share of a token.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .cpu_build import I32, I64, PTR, library
from .quant_matmul import GGML_TYPES, check_weight, quant_matmul_qa_ref, quant_matmul_ref

MAX_ROWS = 64  # rows a C call takes
_ARGTYPES = [I32, I32, PTR, I64, PTR, I64, I64, I64, I64, PTR]


def quant_argmax_ref(x: torch.Tensor, w: torch.Tensor, qtype: str, bits: int | None) -> torch.Tensor:
    """x [M, K] float32 -> [M] int64: the first maximum (or first NaN) of each row of the logits."""
    logits = quant_matmul_qa_ref(x, w, qtype, bits) if bits else quant_matmul_ref(x.float(), w, qtype)
    return logits.max(dim=1).indices


def cpu_function() -> Callable[..., int] | None:
    return library("quant_argmax_cpu.c").function("quant_argmax", torch.float32, _ARGTYPES)


def quant_argmax_cpu_unchecked(fn: Callable[..., int], x: torch.Tensor, w: torch.Tensor, qtype_id: int,
                               bits: int | None) -> torch.Tensor | None:
    """The C call alone on float32 x [M, K] (unit stride, M <= MAX_ROWS) and contiguous w, checked
    by the caller (QuantLinear.greedy)."""
    m, k = x.shape
    out = torch.empty(m, dtype=torch.int64)
    status = fn(bits or 0, qtype_id, x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), m, w.shape[0], k,
                out.data_ptr())
    return out if status == 0 else None


def quant_argmax_cpu(x: torch.Tensor, w: torch.Tensor, qtype: str, bits: int | None) -> torch.Tensor | None:
    """The C kernel; None when it does not apply (then take quant_argmax_ref or the logits)."""
    if not (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
            and x.stride(1) == 1 and w.device.type == "cpu" and w.is_contiguous() and qtype in GGML_TYPES
            and bits in (None, 8, 16)):
        return None
    check_weight(w, qtype, x.shape[1])
    fn = cpu_function()
    return None if fn is None else quant_argmax_cpu_unchecked(fn, x, w, GGML_TYPES[qtype], bits)
