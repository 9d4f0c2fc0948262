"""Neox-style rotary embedding (rotate halves), with partial rotary.

q [T, Hq, D], k [T, Hk, D], cos/sin [T, R/2] for a rotary dim R <= D applied to the first R
channels of every head: (x1, x2) = (x[:R/2], x[R/2:R]) -> (x1*cos - x2*sin, x2*cos + x1*sin);
channels R..D pass through. Math in float32, outputs in the input dtype: new tensors, or q and k
themselves with `apply_rotary_` (in place; e.g. on q/k views of a fused qkv projection, no copies).
"""
from __future__ import annotations

import torch

from ._compat import check_launchable, next_pow2, tl, triton, use_triton
from .cpu_build import I32, I64, PTR, library, on_cpu

_CPU_ARGTYPES = [PTR, I64, I64, PTR, PTR, I64, PTR, I64, I64, I64, I32, I32, I32]


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rotary_dim/2] for integer positions [T]."""
    assert rotary_dim % 2 == 0, rotary_dim
    exponent = torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32) / rotary_dim
    inv_freq = 1.0 / (base ** exponent)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    assert q.dim() == 3 and k.dim() == 3, (q.shape, k.shape)
    assert k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2], (q.shape, k.shape)
    assert cos.shape == sin.shape and cos.shape[0] == q.shape[0], (cos.shape, sin.shape, q.shape)
    half = cos.shape[1]
    assert 0 < 2 * half <= q.shape[2], f"rotary dim {2 * half} > head dim {q.shape[2]}"
    return half


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    xf = x[..., : 2 * half].float()
    x1, x2 = xf[..., :half], xf[..., half:]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if 2 * half == x.shape[-1]:
        return rot
    return torch.cat([rot, x[..., 2 * half:]], dim=-1)


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = _check(q, k, cos, sin)
    c = cos.float()[:, None, :]  # broadcast over heads
    s = sin.float()[:, None, :]
    return _rotate_ref(q, c, s, half), _rotate_ref(k, c, s, half)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, head_dim, half,
                   stride_xt, stride_xh, stride_ct,
                   BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PASS: tl.constexpr):
    # Program (t, hb): BLOCK_H heads of token t; cos/sin are loaded once and shared by the heads.
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < half
    cos = tl.load(cos_ptr + t * stride_ct + r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_ct + r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    h_mask = (heads < n_heads)[:, None]
    m = h_mask & r_mask[None, :]
    x_row = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    o_row = out_ptr + t * n_heads * head_dim + heads[:, None] * head_dim  # out is contiguous
    x1 = tl.load(x_row + r[None, :], mask=m, other=0.0)
    x2 = tl.load(x_row + half + r[None, :], mask=m, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(o_row + r[None, :], (x1f * cos - x2f * sin).to(x1.dtype), mask=m)
    tl.store(o_row + half + r[None, :], (x2f * cos + x1f * sin).to(x1.dtype), mask=m)
    if HAS_PASS:  # partial rotary: channels [2*half, head_dim) are copied unchanged
        d = 2 * half + tl.arange(0, BLOCK_D)
        pm = h_mask & (d < head_dim)[None, :]
        tl.store(o_row + d[None, :], tl.load(x_row + d[None, :], mask=pm, other=0.0), mask=pm)


def _rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    assert x.stride(-1) == 1, "head dim must be contiguous"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    t, h, d = x.shape
    if x.numel() == 0:
        return out
    block_h = min(next_pow2(h), 16)
    pass_dim = d - 2 * half
    _rotary_kernel[(t, triton.cdiv(h, block_h))](
        x, cos, sin, out, h, d, half, x.stride(0), x.stride(1), cos.stride(0),
        BLOCK_H=block_h, BLOCK_R=next_pow2(half), BLOCK_D=next_pow2(max(pass_dim, 1)), HAS_PASS=pass_dim > 0,
    )
    return out


def apply_rotary_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = _check(q, k, cos, sin)
    check_launchable(q, k, cos, sin)
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype
    return _rotate_triton(q, cos, sin, half), _rotate_triton(k, cos, sin, half)


def apply_rotary_cpu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                     inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The C kernel in csrc/elementwise_cpu.c (into new contiguous tensors, or into q and k
    themselves when `inplace`); None when it does not apply."""
    half = _check(q, k, cos, sin)
    fn = library("elementwise_cpu.c").function("rotary", q.dtype, _CPU_ARGTYPES) if on_cpu(q, k) else None
    if fn is None or cos.device.type != "cpu":
        return None
    c, s = cos.float().contiguous(), sin.float().contiguous()
    outs = []
    for x in (q, k):
        out = x if inplace else torch.empty(x.shape, dtype=x.dtype)
        if x.numel() and fn(x.data_ptr(), x.stride(0), x.stride(1), c.data_ptr(), s.data_ptr(), c.stride(0),
                            out.data_ptr(), out.stride(0), out.stride(1), x.shape[0], x.shape[1], x.shape[2], half):
            return None  # head dim > 1024: declined for q already (q and k share it), nothing written
        outs.append(out)
    return outs[0], outs[1]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        return apply_rotary_triton(q, k, cos.contiguous(), sin.contiguous())
    out = apply_rotary_cpu(q, k, cos, sin)
    return out if out is not None else apply_rotary_ref(q, k, cos, sin)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary written into q and k (which must not overlap); returns them."""
    if not use_triton(q) and apply_rotary_cpu(q, k, cos, sin, inplace=True) is not None:
        return q, k
    rq, rk = apply_rotary(q, k, cos, sin)
    return q.copy_(rq), k.copy_(rk)
