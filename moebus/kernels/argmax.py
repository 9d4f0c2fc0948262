"""Row argmax over the last dim of a 2-D tensor (greedy sampling over the vocabulary).

Semantics are torch's `x.max(dim=1).indices`: the first maximum of each row, and a row holding a
NaN gives its first NaN. Returns int64 [B]. torch's CPU reduction reads [64, 49152] float32 far
below the memory's bandwidth; the C kernel takes rows in parallel and each row in vectorised blocks.
"""
from __future__ import annotations

import torch

from ._compat import check_launchable, next_pow2, tl, triton, use_triton
from .cpu_build import I64, PTR, library, on_cpu

_CPU_ARGTYPES = [PTR, I64, I64, I64, PTR]


def row_argmax_ref(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2, x.shape
    return x.max(dim=1).indices


@triton.jit
def _row_argmax_kernel(x_ptr, out_ptr, n_cols, row_stride, BLOCK: tl.constexpr):
    # One program per row, BLOCK columns at a time: the chunk's max and its first index, and the
    # first NaN, folded into running values.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    big = n_cols + BLOCK
    best = float("-inf")
    best_idx = 0
    first_nan = big
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        mask = idx < n_cols
        x = tl.load(x_ptr + row * row_stride + idx, mask=mask, other=float("-inf")).to(tl.float32)
        is_nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan & mask, idx, big), axis=0))
        x = tl.where(is_nan, float("-inf"), x)
        chunk_max = tl.max(x, axis=0)
        chunk_idx = tl.min(tl.where((x == chunk_max) & mask, idx, big), axis=0)
        best_idx = tl.where(chunk_max > best, chunk_idx, best_idx)
        best = tl.maximum(best, chunk_max)
    tl.store(out_ptr + row, tl.where(first_nan < big, first_nan, best_idx).to(tl.int64))


def row_argmax_triton(x: torch.Tensor) -> torch.Tensor:
    check_launchable(x)
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if x.shape[0] and x.shape[1]:
        _row_argmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=min(next_pow2(x.shape[1]), 4096))
    return out


def row_argmax_cpu(x: torch.Tensor) -> torch.Tensor | None:
    """The C kernel in csrc/argmax_cpu.c; None when it does not apply."""
    if x.dim() != 2 or not on_cpu(x) or x.shape[1] == 0:
        return None
    fn = library("argmax_cpu.c").function("row_argmax", x.dtype, _CPU_ARGTYPES)
    if fn is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x) and x.stride(-1) == 1 and x.shape[1]:
        return row_argmax_triton(x)
    out = row_argmax_cpu(x)
    return out if out is not None else row_argmax_ref(x)
