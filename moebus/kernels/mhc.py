"""Mixing weights of a manifold-constrained hyper-connection (mHC, DeepSeek-V4), per token.

From the raw mixture logits `mix [T, (2 + n) * n]` (float32: a linear map of the RMS-normalised
streams; pre [n], post [n], comb [n, n] in that order), `base [(2 + n) * n]` and `scale [3]`:

    pre  = sigmoid(mix_pre * scale[0] + base_pre) + eps                       [T, n]
    post = 2 * sigmoid(mix_post * scale[1] + base_post)                        [T, n]
    comb = softmax_rows(mix_comb * scale[2] + base_comb) + eps                 [T, n, n]
    comb = comb / (column sums + eps), then iters - 1 rounds of row then column normalisation
           (Sinkhorn-Knopp, towards a doubly-stochastic matrix).

The torch reference is ~4 * iters tiny ops per call (~120 at iters = 20, n = 4) and was most of a
HyperConnection's time at decode sizes; the Triton and C kernels do it in one pass per token.

`hc_merge(streams [T, n, H], block_out [T, H], post, comb)` is the other half of an mHC: the new
streams `out[t, k] = post[t, k] * block_out[t] + sum_j comb[t, j, k] * streams[t, j]`. Its reference
is a batched [n, n] x [n, H] matmul, which torch runs as T tiny GEMMs; the kernels stream each token once, in float32, rounding once.

`hc_pre(streams, fn, base, scale, n, iters, hc_eps, norm_eps) -> (block input [T, H], post, comb)`
is the whole first half: RMS-normalise the flattened streams, `mix = linear(x, fn)`, hc_mix, then
collapse the streams with pre. On CPU one C call per token pair replaces ~12 torch ops and the
hc_mix call (the GEMM is 2 tokens x 4 fn rows per register tile). Elsewhere the reference runs,
its hc_mix on Triton for CUDA tensors: on a GPU the mixture GEMM belongs on the tensor cores.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._compat import check_launchable, next_pow2, tl, triton, use_triton
from .cpu_build import F32, I32, I64, PTR, library, on_cpu

_CPU_ARGTYPES = [PTR, I64, PTR, PTR, PTR, PTR, PTR, I64, I32, I32, F32]
_CPU_MERGE_ARGTYPES = [PTR, PTR, PTR, PTR, PTR, I64, I32, I64]
_CPU_PRE_ARGTYPES = [PTR, PTR, PTR, PTR, PTR, PTR, PTR, I64, I32, I64, I32, F32, F32]


def _check(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int) -> None:
    assert mix.dim() == 2 and mix.shape[1] == (2 + n) * n, (tuple(mix.shape), n)
    assert base.shape == ((2 + n) * n,) and scale.shape == (3,), (tuple(base.shape), tuple(scale.shape))
    assert mix.dtype == base.dtype == scale.dtype == torch.float32, (mix.dtype, base.dtype, scale.dtype)
    assert iters >= 1, iters


def hc_mix_ref(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(mix, base, scale, n, iters)
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    s_pre, s_post, s_comb = scale.unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
    post = 2.0 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.reshape(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


@triton.jit
def _hc_mix_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, mix_stride, n, iters, eps,
                   BLOCK_N: tl.constexpr):
    # One program per token; the n x n matrix sits in registers through every Sinkhorn round.
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    m1 = i < n
    row = mix_ptr + t * mix_stride
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(tl.load(row + i, mask=m1, other=0.0) * s_pre + tl.load(base_ptr + i, mask=m1, other=0.0))
    tl.store(pre_ptr + t * n + i, pre + eps, mask=m1)
    post = tl.sigmoid(tl.load(row + n + i, mask=m1, other=0.0) * s_post
                      + tl.load(base_ptr + n + i, mask=m1, other=0.0))
    tl.store(post_ptr + t * n + i, 2.0 * post, mask=m1)
    r = i[:, None]
    c = i[None, :]
    m2 = (r < n) & (c < n)
    x = tl.load(row + 2 * n + r * n + c, mask=m2, other=0.0) * s_comb \
        + tl.load(base_ptr + 2 * n + r * n + c, mask=m2, other=0.0)
    x = tl.where(m2, x, tl.where(r < n, float("-inf"), 0.0))  # padded rows stay finite, dropped below
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    comb = tl.where(m2, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    for _ in range(1, iters):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    tl.store(comb_ptr + t * n * n + r * n + c, comb, mask=m2)


def _outputs(mix: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = mix.shape[0]
    new = mix.new_empty
    return new(t, n), new(t, n), new(t, n, n)


def hc_mix_triton(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_launchable(mix, base, scale)
    _check(mix, base, scale, n, iters)
    assert mix.stride(1) == 1 and base.is_contiguous() and scale.is_contiguous()
    pre, post, comb = _outputs(mix, n)
    if mix.shape[0]:
        _hc_mix_kernel[(mix.shape[0],)](mix, base, scale, pre, post, comb, mix.stride(0), n, iters, eps,
                                        BLOCK_N=next_pow2(n), num_warps=1)
    return pre, post, comb


def hc_mix_cpu(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The C kernel in csrc/mhc_cpu.c; None when it does not apply."""
    if not (on_cpu(mix, base, scale) and mix.stride(1) == 1 and base.is_contiguous() and scale.is_contiguous()):
        return None
    _check(mix, base, scale, n, iters)
    fn = library("mhc_cpu.c").function("hc_mix", torch.float32, _CPU_ARGTYPES)
    if fn is None:
        return None
    pre, post, comb = _outputs(mix, n)
    status = fn(mix.data_ptr(), mix.stride(0), base.data_ptr(), scale.data_ptr(), pre.data_ptr(),
                post.data_ptr(), comb.data_ptr(), mix.shape[0], n, iters, eps)
    return (pre, post, comb) if status == 0 else None


def hc_mix(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(mix):
        return hc_mix_triton(mix, base.contiguous(), scale.contiguous(), n, iters, eps)
    out = hc_mix_cpu(mix, base, scale, n, iters, eps)
    return out if out is not None else hc_mix_ref(mix, base, scale, n, iters, eps)


def _check_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    t, n, h = streams.shape
    assert block_out.shape == (t, h) and block_out.dtype == streams.dtype, (block_out.shape, streams.shape)
    assert post.shape == (t, n) and comb.shape == (t, n, n), (post.shape, comb.shape)


def hc_merge_ref(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor) -> torch.Tensor:
    _check_merge(streams, block_out, post, comb)
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


@triton.jit
def _hc_merge_kernel(s_ptr, b_ptr, post_ptr, comb_ptr, out_ptr, n, H, BLOCK_H: tl.constexpr):
    # One program per (token, output stream) and BLOCK_H columns.
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.load(post_ptr + t * n + k).to(tl.float32) * tl.load(b_ptr + t * H + cols, mask=mask, other=0.0)
    for j in range(0, n):
        c = tl.load(comb_ptr + t * n * n + j * n + k).to(tl.float32)
        acc += c * tl.load(s_ptr + (t * n + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (t * n + k) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def hc_merge_triton(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                    comb: torch.Tensor) -> torch.Tensor:
    check_launchable(streams, block_out, post, comb)
    _check_merge(streams, block_out, post, comb)
    streams, block_out = streams.contiguous(), block_out.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    t, n, h = streams.shape
    out = torch.empty_like(streams)
    if out.numel():
        block = min(next_pow2(h), 1024)
        _hc_merge_kernel[(t, n, triton.cdiv(h, block))](streams, block_out, post, comb, out, n, h, BLOCK_H=block)
    return out


def hc_merge_cpu(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor) -> torch.Tensor | None:
    """The C kernel in csrc/mhc_cpu.c; None when it does not apply."""
    _check_merge(streams, block_out, post, comb)
    if not (on_cpu(streams, block_out) and streams.is_contiguous() and block_out.is_contiguous()
            and post.device.type == comb.device.type == "cpu"):
        return None
    fn = library("mhc_cpu.c").function("hc_merge", streams.dtype, _CPU_MERGE_ARGTYPES)
    if fn is None:
        return None
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty_like(streams)
    t, n, h = streams.shape
    status = fn(streams.data_ptr(), block_out.data_ptr(), post.data_ptr(), comb.data_ptr(), out.data_ptr(), t, n, h)
    return out if status == 0 else None


def hc_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
    if use_triton(streams):
        return hc_merge_triton(streams, block_out, post, comb)
    # The first layer's streams are the embedding expanded n times (a stride-0 view): one copy is
    # far cheaper than the reference's T tiny GEMMs.
    out = hc_merge_cpu(streams.contiguous(), block_out.contiguous(), post, comb)
    return out if out is not None else hc_merge_ref(streams, block_out, post, comb)


def _check_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int,
               iters: int) -> None:
    t, n_s, h = streams.shape
    assert n_s == n and fn.shape == ((2 + n) * n, n * h), (tuple(streams.shape), tuple(fn.shape), n)
    assert fn.dtype == base.dtype == scale.dtype == torch.float32, (fn.dtype, base.dtype, scale.dtype)
    assert base.shape == ((2 + n) * n,) and scale.shape == (3,) and iters >= 1


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def hc_pre_ref(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int,
               iters: int, hc_eps: float, norm_eps: float,
               linear: Linear = F.linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`linear` lets deterministic mode pass its batch-invariant GEMM."""
    _check_pre(streams, fn, base, scale, n, iters)
    x = streams.flatten(1).float()
    mix = linear(x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps), fn)
    pre, post, comb = hc_mix(mix, base, scale, n, iters, hc_eps)
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype), post, comb


def hc_pre_cpu(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int,
               iters: int, hc_eps: float,
               norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The C kernel in csrc/mhc_cpu.c; None when it does not apply. Each token's result is
    computed on its own, so it is batch-invariant."""
    if not (streams.dim() == 3 and on_cpu(streams) and fn.device.type == "cpu"):
        return None
    _check_pre(streams, fn, base, scale, n, iters)
    fn_ = library("mhc_cpu.c").function("hc_pre", streams.dtype, _CPU_PRE_ARGTYPES)
    if fn_ is None:
        return None
    streams, fn, base, scale = streams.contiguous(), fn.contiguous(), base.contiguous(), scale.contiguous()
    t, _, h = streams.shape
    collapsed = streams.new_empty(t, h)
    post, comb = fn.new_empty(t, n), fn.new_empty(t, n, n)
    status = fn_(streams.data_ptr(), fn.data_ptr(), base.data_ptr(), scale.data_ptr(), collapsed.data_ptr(),
                 post.data_ptr(), comb.data_ptr(), t, n, h, iters, hc_eps, norm_eps)
    return (collapsed, post, comb) if status == 0 else None


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
           hc_eps: float, norm_eps: float,
           linear: Linear = F.linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU: the C kernel (batch-invariant by construction); else, or when it does not apply, the
    reference with `linear` for its GEMM."""
    out = hc_pre_cpu(streams, fn, base, scale, n, iters, hc_eps, norm_eps) if streams.device.type == "cpu" else None
    return out if out is not None else hc_pre_ref(streams, fn, base, scale, n, iters, hc_eps, norm_eps, linear)
