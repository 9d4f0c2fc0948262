"""The panel linear (kernels/panel_linear.py, csrc/panel_linear_cpu.c), bf16 and float32, against
float64 and F.linear, on row counts that hit every register tile (blocks of 12 rows and fewer, wide
tiles' leftover panels, several row blocks) and with strided rows and a bias; a row's result must
not depend on the other rows; shapes it does not take are declined, and so are builds without the
instructions."""
import ctypes

import pytest
import torch

from moebus.kernels import cpu_build
from moebus.kernels.lm_head_argmax import pack_panels
from moebus.kernels.paged_attention import cpu_kernel_available
from moebus.kernels.panel_linear import (
    _CPU_ARGTYPES,
    panel_linear_cpu,
    panel_linear_float_ref,
    panel_linear_ref,
)
from moebus.platforms.cpu.flags import cpu_flags

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")
DTYPES = pytest.mark.parametrize("dtype", [
    pytest.param(torch.bfloat16, id="bf16",
                 marks=pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="bf16 needs AVX512-BF16")),
    pytest.param(torch.float32, id="fp32",
                 marks=pytest.mark.skipif("avx512f" not in cpu_flags(), reason="float32 needs AVX-512"))])
TOL = {torch.bfloat16: (1e-2, 1.6e-2), torch.float32: (1e-5, 1e-5)}
ROWS = [1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 17, 31, 40, 64, 129]


def _weights(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return w, pack_panels(w)


@DTYPES
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", [(48, 64), (144, 96), (16, 32)])  # 3, 9 and 1 panels: wide tiles' leftovers
def test_matches_float64_and_f_linear(rows, n, k, dtype, close):
    w, panels = _weights(n, k, dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    out = panel_linear_cpu(x, panels, n, k)
    assert out is not None and out.shape == (rows, n) and out.dtype == dtype
    close(out, x.double() @ w.double().T, *TOL[dtype])
    close(out, panel_linear_ref(x, w), *TOL[dtype])


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="bf16 needs AVX512-BF16")
@pytest.mark.parametrize("rows", ROWS)
def test_bf16_float_out_gives_the_float32_sums(rows, close):
    """float_out (an LM head's logits): bf16 in, the float32 sums out, not rounded to bf16; a row's
    result does not depend on the other rows."""
    n, k = 144, 96
    w, panels = _weights(n, k, torch.bfloat16)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    out = panel_linear_cpu(x, panels, n, k, float_out=True)
    assert out is not None and out.dtype == torch.float32
    close(out, x.double() @ w.double().T, 1e-5, 1e-5)  # far inside bf16's steps (TOL)
    close(out, panel_linear_float_ref(x, w), 1e-5, 1e-5)
    alone = torch.cat([panel_linear_cpu(x[i:i + 1], panels, n, k, float_out=True) for i in range(rows)])
    assert torch.equal(out, alone)


@DTYPES
def test_bias_and_strided_rows(dtype, close):
    n, k = 64, 128
    w, panels = _weights(n, k, dtype)
    wide = torch.randn(21, k + 32).to(dtype)
    x = wide[:, 16:16 + k]  # rows k + 32 apart
    assert x.stride(0) == k + 32
    bias = torch.randn(n).to(dtype)
    out = panel_linear_cpu(x, panels, n, k, bias)
    close(out, x.double() @ w.double().T + bias.double(), *TOL[dtype])
    close(out, panel_linear_ref(x, w, bias), *TOL[dtype])


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="float32 needs AVX-512")
def test_float32_takes_any_k(close):
    """(bf16 panels come in whole k pairs of 32)"""
    w, panels = _weights(48, 40, torch.float32)
    x = torch.randn(7, 40)
    close(panel_linear_cpu(x, panels, 48, 40), x.double() @ w.double().T, *TOL[torch.float32])


@DTYPES
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
    n, k = 96, 192
    w, panels = _weights(n, k, dtype)
    x = torch.randn(37, k).to(dtype)
    whole = panel_linear_cpu(x, panels, n, k)
    for i in (0, 8, 16, 36):
        assert torch.equal(panel_linear_cpu(x[i:i + 1], panels, n, k)[0], whole[i])
        assert torch.equal(panel_linear_cpu(x[i:i + 5], panels, n, k)[0], whole[i])


@DTYPES
def test_declines_what_it_does_not_cover(dtype):
    w, panels = _weights(48, 64, dtype)
    x = torch.randn(3, 64).to(dtype)
    assert panel_linear_cpu(x.half(), pack_panels(w.half()), 48, 64) is None  # bf16 and float32 only
    if dtype == torch.bfloat16:
        assert panel_linear_cpu(x[:, :40], pack_panels(w[:, :40]), 48, 40) is None  # k not whole 32s
    assert panel_linear_cpu(x, pack_panels(w[:40]), 40, 64) is None  # n not whole panels
    assert panel_linear_cpu(x.t().contiguous().t(), panels, 48, 64) is None  # columns strided


@pytest.mark.parametrize("flags,declined", [(["-mno-avx512bf16"], ["bf16"]), (cpu_build.NO_AVX512, ["bf16", "f32"])],
                         ids=["no-avx512-bf16", "avx2"])
def test_a_build_without_the_instructions_declines(rebuilt, flags, declined, close):
    lib = rebuilt("panel_linear_cpu.c", flags, "-".join(declined))
    for suffix, dtype in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        fn = getattr(lib, f"panel_linear_{suffix}")
        fn.argtypes, fn.restype = _CPU_ARGTYPES, ctypes.c_int
        w, panels = _weights(48, 64, dtype)
        x = torch.randn(3, 64).to(dtype)
        out = torch.empty(3, 48, dtype=dtype)
        status = fn(x.data_ptr(), 64, panels.data_ptr(), None, 3, 48, 64, out.data_ptr(), 48)
        assert status == (1 if suffix in declined else 0)
        if status == 0:
            close(out, x.double() @ w.double().T, *TOL[dtype])
