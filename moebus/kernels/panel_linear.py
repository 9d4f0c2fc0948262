"""A linear for few rows (decode batches) on AVX-512 CPUs, bf16 (AVX512-BF16) and float32:
csrc/panel_linear_cpu.c.

The reference is F.linear: float32 sums (of bf16 products, rounded to bf16 once); with
float_out=True (an LM head's logits) the float32 sums themselves, as F.linear in float32 on the
same values gives them (panel_linear_float_ref). The kernel reads
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


def panel_linear_float_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if bias is None else bias.float())


def panel_linear_applies(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes a weight of n x k in `dtype` (it may still decline at the call: a
    build without AVX512-BF16 or AVX-512)."""
    if dtype == torch.bfloat16:
        return n % 16 == 0 and k % 32 == 0 and n > 0 and k > 0
    return dtype == torch.float32 and n % 16 == 0 and n > 0 and k > 0


class PanelLinear:
    """The kernel bound to one packed weight: what does not depend on the input (the entry point,
    the layout check, the bias in float32) is done once, so a decode step's ~120 calls pay only
    for the input's checks and the call."""

    def __init__(self, panels: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None, *,
                 float_out: bool = False) -> None:
        """float_out: the output in float32 whatever the weight's dtype (bf16's sums not rounded)."""
        self.panels, self.n, self.k, self.dtype = panels, n, k, panels.dtype
        self.out_dtype = torch.float32 if float_out else panels.dtype
        ok = panel_linear_applies(n, k, panels.dtype) and on_cpu(panels)
        self.fn = _entry(panels.dtype, float_out) if ok else None
        if self.fn is not None:
            assert panels.shape == panels_shape(n, k, panels.dtype) and panels.is_contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, k] in the weight's dtype, last dim contiguous -> [M, n] (out_dtype); None where
        the kernel does not apply."""
        fn = self.fn
        if (fn is None or x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.k or x.shape[0] == 0
                or x.stride(1) != 1 or x.device.type != "cpu"):
            return None
        b = self.bias
        out = torch.empty(x.shape[0], self.n, dtype=self.out_dtype)
        status = fn(x.data_ptr(), x.stride(0), self.panels.data_ptr(), None if b is None else b.data_ptr(),
                    x.shape[0], self.n, self.k, out.data_ptr(), out.stride(0))
        return out if status == 0 else None


def _entry(dtype: torch.dtype, float_out: bool):
    lib = library("panel_linear_cpu.c")
    if float_out and dtype == torch.bfloat16:
        return lib.entry("panel_linear_bf16f", _CPU_ARGTYPES)
    return lib.function("panel_linear", dtype, _CPU_ARGTYPES)


def panel_linear_cpu(x: torch.Tensor, panels: torch.Tensor, n: int, k: int,
                     bias: torch.Tensor | None = None, *, float_out: bool = False) -> torch.Tensor | None:
    """x [M, k] (bf16 or float32, last dim contiguous) . the weight packed by pack_panels -> [M, n]
    in x's dtype (float32 with float_out); None where the kernel does not apply. bias: [n], any float
    dtype (added in float32).
    For repeated calls on one weight, bind a PanelLinear once."""
    if x.dtype != panels.dtype:
        return None
    return PanelLinear(panels, n, k, bias, float_out=float_out)(x)
