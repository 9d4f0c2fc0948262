"""Softmax-gated window pooling of the DeepSeek-V4 KV compressor (HF DeepseekV4{HCA,CSA}Compressor).

    out[n, c] = sum_l softmax_l(gate[n, l, c] + bias[l, c]) * kv[n, l, c]

kv, gate [N, L, C] (one row per closed window, L source slots), bias [L, C] (the learned
per-slot `position_bias`). Softmax and sum in float32, one rounding to kv's dtype. A gate of
-inf gives its slot weight 0 (CSA's first window has no previous window to overlap with); every
(n, c) needs at least one finite gate.
"""
from __future__ import annotations

import torch

from ._compat import check_launchable, next_pow2, tl, triton, use_triton
from .cpu_build import I32, I64, PTR, library, on_cpu

_CPU_ARGTYPES = [PTR, PTR, PTR, PTR, I64, I32, I32]


def _check(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> None:
    assert kv.dim() == 3 and gate.shape == kv.shape, (kv.shape, gate.shape)
    assert bias.shape == kv.shape[1:], (bias.shape, kv.shape)


def compress_windows_ref(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _check(kv, gate, bias)
    w = (gate.float() + bias.float()).softmax(dim=1)
    return (w * kv.float()).sum(dim=1).to(kv.dtype)


@triton.jit
def _compress_kernel(kv_ptr, gate_ptr, bias_ptr, out_ptr, L, C,
                     BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    # Program (n, cb): the whole window (L <= BLOCK_L slots) of BLOCK_C channels in registers.
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    l_ = tl.arange(0, BLOCK_L)
    mask = (l_[:, None] < L) & (c[None, :] < C)
    off = l_[:, None] * C + c[None, :]
    g = tl.load(gate_ptr + n * L * C + off, mask=mask, other=0.0).to(tl.float32)
    g = tl.where(l_[:, None] < L, g, float("-inf"))  # padding slots weigh 0; padding channels stay finite
    g += tl.load(bias_ptr + off, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(kv_ptr + n * L * C + off, mask=mask, other=0.0).to(tl.float32)
    m = tl.max(g, axis=0)
    e = tl.exp(g - m[None, :])
    acc = tl.sum(e * x, axis=0) / tl.sum(e, axis=0)
    tl.store(out_ptr + n * C + c, acc.to(out_ptr.dtype.element_ty), mask=c < C)


def compress_windows_triton(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _check(kv, gate, bias)
    check_launchable(kv, gate, bias)
    kv, gate, bias = kv.contiguous(), gate.contiguous(), bias.contiguous()
    n, L, C = kv.shape
    out = torch.empty(n, C, dtype=kv.dtype, device=kv.device)
    if n == 0:
        return out
    block_c = min(next_pow2(C), 64)
    _compress_kernel[(n, triton.cdiv(C, block_c))](kv, gate, bias, out, L, C, BLOCK_L=next_pow2(L),
                                                   BLOCK_C=block_c)
    return out


def compress_windows_cpu(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor | None:
    """The C kernel in csrc/compressor_cpu.c; None when it does not apply."""
    _check(kv, gate, bias)
    if not on_cpu(kv, gate) or bias.dtype != torch.float32 or bias.device.type != "cpu":
        return None
    fn = library("compressor_cpu.c").function("compress_windows", kv.dtype, _CPU_ARGTYPES)
    if fn is None:
        return None
    kv, gate, bias = kv.contiguous(), gate.contiguous(), bias.contiguous()
    n, L, C = kv.shape
    out = torch.empty(n, C, dtype=kv.dtype)
    if n and fn(kv.data_ptr(), gate.data_ptr(), bias.data_ptr(), out.data_ptr(), n, L, C) != 0:
        return None
    return out


def compress_windows(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if use_triton(kv):
        return compress_windows_triton(kv, gate, bias)
    out = compress_windows_cpu(kv, gate, bias)
    return out if out is not None else compress_windows_ref(kv, gate, bias)
