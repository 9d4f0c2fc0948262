"""RMSNorm and fused residual-add + RMSNorm over the last dim, computed in float32.

`fused_add_rms_norm` returns (rmsnorm(x + residual), x + residual); the sum is rounded to the
input dtype first and the norm is taken of that rounded value, as an unfused model would.
"""
from __future__ import annotations

import torch

from ._compat import check_launchable, next_pow2, tl, triton, use_triton
from .cpu_build import F32, I32, I64, PTR, library, on_cpu

_CPU_ARGTYPES = [PTR, I64, PTR, I64, PTR, PTR, PTR, I64, I32, F32]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps) * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # One program per row; the whole row sits in registers (BLOCK >= n_cols).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * n_cols + cols, s, mask=mask)
        x = s
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_launchable(x, weight)
    n = x.shape[-1]
    assert weight.shape == (n,), f"weight {tuple(weight.shape)} vs hidden {n}"
    assert x.is_contiguous() and weight.is_contiguous()
    out = torch.empty_like(x)
    res_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
        res_out = torch.empty_like(x)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return out, res_out
    block = next_pow2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out if res_out is not None else out,
        n, eps, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(max(block // 256, 1), 16),
    )
    return out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, res = _launch(x, residual, weight, eps)
    assert res is not None
    return out, res


def _rows(x: torch.Tensor) -> int | None:
    """Row stride when x is a stack of rows (contiguous, or 2-D with a contiguous last dim)."""
    if x.is_contiguous():
        return x.shape[-1]
    return x.stride(0) if x.dim() == 2 and x.stride(1) == 1 else None


def _launch_cpu(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The C kernel in csrc/elementwise_cpu.c; None when it does not apply."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if not on_cpu(*tensors) or not weight.is_contiguous() or weight.shape != (x.shape[-1],):
        return None
    xs, rs = _rows(x), _rows(residual) if residual is not None else 0
    fn = library("elementwise_cpu.c").function("rms_norm", x.dtype, _CPU_ARGTYPES)
    if fn is None or xs is None or rs is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    res_out = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    n = x.shape[-1]
    status = fn(x.data_ptr(), xs, residual.data_ptr() if residual is not None else None, rs, weight.data_ptr(),
                out.data_ptr(), res_out.data_ptr() if res_out is not None else None, x.numel() // max(n, 1), n, eps)
    return (out, res_out) if status == 0 else None


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    res = _launch_cpu(x, None, weight, eps)
    return None if res is None else res[0]


def fused_add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    if residual.shape != x.shape:
        return None
    return _launch_cpu(x, residual, weight, eps)  # type: ignore[return-value]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return rms_norm_triton(x.contiguous(), weight.contiguous(), eps)
    out = rms_norm_cpu(x, weight, eps)
    return out if out is not None else rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return fused_add_rms_norm_triton(x.contiguous(), residual.contiguous(), weight.contiguous(), eps)
    out = fused_add_rms_norm_cpu(x, residual, weight, eps)
    return out if out is not None else fused_add_rms_norm_ref(x, residual, weight, eps)
