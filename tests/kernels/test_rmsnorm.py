import pytest
import torch

from moebus.kernels import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
)

EPS = 1e-6
# (atol, rtol): bf16 allows ~1 ulp of output rounding (the interpreter truncates where CUDA rounds).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
SHAPES = [(1, 64), (17, 81), (33, 145), (2, 5, 64)]  # odd hidden sizes are 2^k + 17


def naive_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w.double()


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu"):
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    r = torch.randn(shape, dtype=dtype, device=device)
    w = torch.rand(shape[-1], dtype=dtype, device=device) + 0.5
    return x, r, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_ref_matches_fp64(shape, dtype, close):
    x, r, w = _inputs(shape, dtype)
    out = rms_norm_ref(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    close(out, naive_rms_norm(x, w), *TOL[dtype])
    normed, res = fused_add_rms_norm_ref(x, r, w, EPS)
    close(res, x.double() + r.double(), *TOL[dtype])
    close(normed, naive_rms_norm(x.double() + r.double(), w), *TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_ref(shape, dtype, triton_device, close):
    x, r, w = _inputs(shape, dtype, triton_device)
    close(rms_norm_triton(x, w, EPS), rms_norm_ref(x, w, EPS), *TOL[dtype])
    normed, res = fused_add_rms_norm_triton(x, r, w, EPS)
    normed_ref, res_ref = fused_add_rms_norm_ref(x, r, w, EPS)
    assert normed.dtype == res.dtype == dtype
    close(res, res_ref, *TOL[dtype])
    close(normed, normed_ref, *TOL[dtype])


def test_triton_float32_weight_with_bf16_input(triton_device, close):
    x, _, w = _inputs((17, 81), torch.bfloat16, triton_device)
    w = w.float()
    out = rms_norm_triton(x, w, EPS)
    assert out.dtype == torch.bfloat16
    close(out, rms_norm_ref(x, w, EPS), *TOL[torch.bfloat16])


def test_dispatch_cpu_uses_reference():
    x, r, w = _inputs((17, 81), torch.bfloat16)
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))
    for a, b in zip(fused_add_rms_norm(x, r, w, EPS), fused_add_rms_norm_ref(x, r, w, EPS), strict=True):
        assert torch.equal(a, b)
