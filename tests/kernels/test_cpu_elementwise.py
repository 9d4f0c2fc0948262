"""The C kernels in kernels/csrc/elementwise_cpu.c against their torch references (and float64),
for the native build and the builds smaller CPUs get: AVX-512 without vcvtneps2bf16, AVX2, scalar."""
import pytest
import torch

from moebus.kernels import cpu_build, rmsnorm, rotary, silu_mul
from moebus.kernels.paged_attention import cpu_kernel_available
from moebus.kernels.rmsnorm import fused_add_rms_norm_cpu, fused_add_rms_norm_ref, rms_norm_cpu, rms_norm_ref
from moebus.kernels.rotary import apply_rotary_, apply_rotary_cpu, apply_rotary_ref, rotary_cos_sin
from moebus.kernels.silu_mul import silu_and_mul_cpu, silu_and_mul_ref

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
# Same float32 math, so outputs differ by summation order / rsqrt rounding: about one ulp of the dtype.
TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-3)}
# build -> (extra flags, elementwise_isa() it must report given the native build's).
BUILDS = {"native": None, "avx512-no-bf16": (["-mno-avx512bf16"], lambda native: min(native, 1)),
          "avx2": (cpu_build.NO_AVX512, lambda native: 0), "scalar": (cpu_build.SCALAR, lambda native: 0)}


@pytest.fixture(scope="module")
def _libs(rebuilt):
    native = cpu_build.library("elementwise_cpu.c").get().elementwise_isa()
    libs = {}
    for name, spec in BUILDS.items():
        if spec is not None:
            lib = rebuilt("elementwise_cpu.c", spec[0], name)
            assert lib.elementwise_isa() == spec[1](native), name
            libs[name] = lib
    return libs


@pytest.fixture(autouse=True, params=list(BUILDS))
def build(request, _libs, monkeypatch):
    """Every test below runs once per build: the wrappers get that build's library."""
    if request.param != "native":
        handle = cpu_build.CpuLibrary("elementwise_cpu.c")
        handle._lib, handle._tried = _libs[request.param], True
        for module in (rmsnorm, rotary, silu_mul):
            monkeypatch.setattr(module, "library", lambda source, h=handle: h)
    return request.param


@DTYPES
@pytest.mark.parametrize("rows,n", [(1, 64), (3, 17), (37, 576), (61, 577), (5, 4113)])
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
@pytest.mark.parametrize("shape", [(1, 2), (33, 2 * 1536), (23, 2 * 1537), (2, 3, 2 * 17)])
def test_silu_and_mul(dtype, limit, shape, close):
    x = torch.randn(*shape, dtype=dtype) * 4  # reach both tails of silu and the clamps
    out = silu_and_mul_cpu(x, limit=limit)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    close(out, silu_and_mul_ref(x, limit=limit), *TOL[dtype])


def test_silu_and_mul_strided_rows(close):
    x = torch.randn(40, 2 * 531 + 7)[:, : 2 * 531]  # rows with a stride != 2I
    close(silu_and_mul_cpu(x), silu_and_mul_ref(x), *TOL[torch.float32])


def test_silu_and_mul_float64_relative_error():
    # The vectorised exp and the reciprocal of the AVX-512 path: within 2 ulp of float32 where silu
    # is a normal float (torch's own: ~1.5 ulp).
    g = torch.linspace(-87, 88, 300_001)
    out = silu_and_mul_cpu(torch.stack([g, torch.ones_like(g)], dim=1))[:, 0].double()
    want = g.double() * torch.sigmoid(g.double())
    assert ((out - want).abs() / want.abs().clamp_min(1e-30)).max() < 2.5e-7


def test_silu_and_mul_special_gates():
    gate = torch.tensor([float("-inf"), float("inf"), float("nan"), -100.0, -1e30, 1e30, 0.0, -0.0])
    up = torch.tensor([2.0, 2.0, 1.0, 1.0, 1.0, 1.0, float("inf"), 1.0])
    out = silu_and_mul_cpu(torch.cat([gate, up])[None])
    torch.testing.assert_close(out, silu_and_mul_ref(torch.cat([gate, up])[None]), equal_nan=True)


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


@DTYPES
def test_rms_norm_nonfinite_rows(dtype):
    x = torch.randn(4, 40, dtype=dtype)
    x[1, 7], x[2, 3] = float("inf"), float("nan")  # as the reference: inf/NaN rows come out NaN/0
    w = torch.randn(40, dtype=dtype)
    torch.testing.assert_close(rms_norm_cpu(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), equal_nan=True,
                               atol=TOL[dtype][0], rtol=TOL[dtype][1])


@DTYPES
@pytest.mark.parametrize("rotary_dim", [64, 34])  # full, and a half (17) that is no multiple of a vector
def test_rotary_in_place_on_fused_qkv(dtype, rotary_dim, close):
    t, hq, hk, d = 45, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype)
    before = qkv.clone()
    q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    cos, sin = rotary_cos_sin(torch.arange(7, 7 + t), rotary_dim, 10000.0)
    want = apply_rotary_ref(q, k, cos, sin)
    got = apply_rotary_(q, k, cos, sin)
    assert got[0].data_ptr() == qkv.data_ptr() and got[1].data_ptr() == k.data_ptr()
    close(q, want[0], *TOL[dtype])
    close(k, want[1], *TOL[dtype])
    assert torch.equal(qkv[:, (hq + hk) * d:], before[:, (hq + hk) * d:])  # v untouched
    assert torch.equal(q[..., rotary_dim:], before[:, : hq * d].view(t, hq, d)[..., rotary_dim:])
