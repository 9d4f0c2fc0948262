"""A linear for few rows (decode batches) on AVX-512 CPUs, bf16 (AVX512-BF16) and float32:
csrc/panel_linear_cpu.c.

The reference is F.linear: float32 sums (of bf16 products, rounded to bf16 once). The kernel reads
the weight in pack_panels' layout (kernels/lm_head_argmax.py; the LM head's kernel reads the same)
and only differs from the reference in summation order. A row's result does not depend on the
other rows of the call. GPUs keep F.linear (cuBLAS); there is no Triton version to beat it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_build import I64, PTR, library, on_cpu
from .lm_head_argmax import panels_shape

_CPU_ARGTYPES = [PTR, I64, PTR, PTR, I64, I64, I64, PTR, I64]


def panel_linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, bias)


def panel_linear_applies(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes a weight of n x k in `dtype` (it may still decline at the call: a
    build without AVX512-BF16 or AVX-512)."""
    if dtype == torch.bfloat16:
        return n % 16 == 0 and k % 32 == 0 and n > 0 and k > 0
    return dtype == torch.float32 and n % 16 == 0 and n > 0 and k > 0


def panel_linear_cpu(x: torch.Tensor, panels: torch.Tensor, n: int, k: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, k] (bf16 or float32, last dim contiguous) . the weight packed by pack_panels -> [M, n]
    in x's dtype; None where the kernel does not apply. bias: [n], any float dtype (added in float32)."""
    if not (x.dim() == 2 and x.shape[1] == k and x.shape[0] > 0 and panel_linear_applies(n, k, x.dtype)
            and on_cpu(x, panels)):
        return None
    fn = library("panel_linear_cpu.c").function("panel_linear", x.dtype, _CPU_ARGTYPES)
    if fn is None:
        return None
    assert panels.shape == panels_shape(n, k, x.dtype) and panels.is_contiguous()
    b = None if bias is None else bias.detach().float().contiguous()
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    status = fn(x.data_ptr(), x.stride(0), panels.data_ptr(), None if b is None else b.data_ptr(), x.shape[0], n, k,
                out.data_ptr(), out.stride(0))
    return out if status == 0 else None
