"""The C kernels in kernels/csrc/elementwise_cpu.c against their torch references."""
import pytest
import torch

from moebus.kernels.paged_attention import cpu_kernel_available
from moebus.kernels.rmsnorm import fused_add_rms_norm_cpu, fused_add_rms_norm_ref, rms_norm_cpu, rms_norm_ref
from moebus.kernels.rotary import apply_rotary_cpu, apply_rotary_ref, rotary_cos_sin
from moebus.kernels.silu_mul import silu_and_mul_cpu, silu_and_mul_ref

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
# Same float32 math, so outputs differ by summation order / rsqrt rounding: about one ulp of the dtype.
TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-3)}


@DTYPES
@pytest.mark.parametrize("rows,n", [(1, 64), (37, 576), (5, 4113)])
def test_rms_norm(dtype, rows, n, close):
    x, res = torch.randn(rows, n, dtype=dtype) * 3, torch.randn(rows, n, dtype=dtype)
    w = torch.randn(n, dtype=dtype)
    close(rms_norm_cpu(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), *TOL[dtype])
    out, new_res = fused_add_rms_norm_cpu(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res)  # one rounding of an exact float32 sum: bitwise equal
    close(out, ref_out, *TOL[dtype])


def test_rms_norm_strided_rows_and_declines(close):
    base = torch.randn(8, 96)
    x = base[:, :64]  # rows with a stride != n
    w = torch.randn(64)
    close(rms_norm_cpu(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), *TOL[torch.float32])
    assert rms_norm_cpu(x.double(), w.double(), 1e-5) is None
    assert rms_norm_cpu(x, w.bfloat16(), 1e-5) is None  # mixed dtypes go to the reference
    assert rms_norm_cpu(torch.randn(2, 3, 4)[:, :2], torch.randn(4), 1e-5) is None  # not a stack of rows


@DTYPES
@pytest.mark.parametrize("limit", [None, 1.5])
@pytest.mark.parametrize("shape", [(1, 2), (33, 2 * 1536), (2, 3, 2 * 17)])
def test_silu_and_mul(dtype, limit, shape, close):
    x = torch.randn(*shape, dtype=dtype) * 4  # reach both tails of silu and the clamps
    out = silu_and_mul_cpu(x, limit=limit)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    close(out, silu_and_mul_ref(x, limit=limit), *TOL[dtype])


def test_silu_and_mul_extreme_gates_are_finite():
    x = torch.tensor([[-200.0, -88.0, 0.0, 90.0, 1.0, 1.0, 1.0, 1.0]])
    out = silu_and_mul_cpu(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=1e-5, atol=1e-6)


@DTYPES
@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotary
def test_rotary_strided_views(dtype, rotary_dim, close):
    t, hq, hk, d = 19, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype)  # q, k as views of a fused projection
    q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    cos, sin = rotary_cos_sin(torch.arange(100, 100 + t), rotary_dim, 10000.0)
    for got, want in zip(apply_rotary_cpu(q, k, cos, sin), apply_rotary_ref(q, k, cos, sin), strict=True):
        assert got.is_contiguous() and got.dtype == dtype
        close(got, want, *TOL[dtype])
