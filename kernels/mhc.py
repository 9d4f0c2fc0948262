"""Mixing weights of a manifold-constrained hyper-connection (mHC, DeepSeek-V4), per token.

From the raw mixture logits `mix [T, (2 + n) * n]` (float32: a linear map of the RMS-normalised
streams; pre [n], post [n], comb [n, n] in that order), `base [(2 + n) * n]` and `scale [3]`:

    pre  = sigmoid(mix_pre * scale[0] + base_pre) + eps                       [T, n]
    post = 2 * sigmoid(mix_post * scale[1] + base_post)                        [T, n]
    comb = softmax_rows(mix_comb * scale[2] + base_comb) + eps                 [T, n, n]
    comb = comb / (column sums + eps), then iters - 1 rounds of row then column normalisation
           (Sinkhorn-Knopp, towards a doubly-stochastic matrix).

The torch reference is ~4 * iters tiny ops per call (~120 at iters = 20, n = 4) and was 80% of a
HyperConnection's time at decode sizes; the Triton and C kernels do it in one pass per token.
"""
from __future__ import annotations

import torch

from ._compat import check_launchable, next_pow2, tl, triton, use_triton
from .cpu_build import F32, I32, I64, PTR, library, on_cpu

_CPU_ARGTYPES = [PTR, I64, PTR, PTR, PTR, PTR, PTR, I64, I32, I32, F32]


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
