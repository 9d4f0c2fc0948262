"""SwiGLU activation: [..., 2I] -> [..., I] = silu(x[..., :I]) * x[..., I:], math in float32.

`limit` (keyword-only, optional) clamps the gate to max=limit and the up half to [-limit, limit]
first, as DeepSeek-V4 / gpt-oss style swiglu limits do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._compat import check_launchable, next_pow2, tl, triton, use_triton
from .cpu_build import F32, I32, I64, PTR, library, on_cpu

_CPU_ARGTYPES = [PTR, I64, PTR, I64, I32, I32, F32]


def silu_and_mul_ref(x: torch.Tensor, *, limit: float | None = None) -> torch.Tensor:
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter].float(), x[..., inter:].float()
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return (F.silu(gate) * up).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, limit, BLOCK: tl.constexpr, HAS_LIMIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    if HAS_LIMIT:
        gf = tl.minimum(gf, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    y = gf / (1.0 + tl.exp(-gf)) * u
    tl.store(out_ptr + row * inter + cols, y.to(g.dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, *, limit: float | None = None) -> torch.Tensor:
    check_launchable(x)
    assert x.shape[-1] % 2 == 0 and x.is_contiguous(), (x.shape, x.stride())
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or inter == 0:
        return out
    block = min(next_pow2(inter), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        x, out, inter, 0.0 if limit is None else float(limit), BLOCK=block, HAS_LIMIT=limit is not None,
    )
    return out


def silu_and_mul_cpu(x: torch.Tensor, *, limit: float | None = None) -> torch.Tensor | None:
    """The C kernel in csrc/elementwise_cpu.c; None when it does not apply."""
    fn = library("elementwise_cpu.c").function("silu_mul", x.dtype, _CPU_ARGTYPES) if on_cpu(x) else None
    if fn is None or x.shape[-1] % 2 or not (x.is_contiguous() or x.dim() == 2):
        return None
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows:
        fn(x.data_ptr(), x.shape[-1] if x.is_contiguous() else x.stride(0), out.data_ptr(), rows, inter,
           limit is not None, 0.0 if limit is None else float(limit))
    return out


def silu_and_mul(x: torch.Tensor, *, limit: float | None = None) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x.contiguous(), limit=limit)
    out = silu_and_mul_cpu(x, limit=limit)
    return out if out is not None else silu_and_mul_ref(x, limit=limit)
