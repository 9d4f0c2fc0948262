"""The bf16 panel linear (kernels/panel_linear.py, csrc/panel_linear_cpu.c) against float64 and
F.linear, on row counts that hit every register tile (blocks of 12 rows and fewer, wide tiles' leftover
panels, several row blocks) and with strided rows and a bias; a row's result must not depend on
the other rows; shapes it does not take are declined, and so are CPUs without AVX512-BF16."""
import ctypes

import pytest
import torch

from moebus.engine.dtype_choice import cpu_flags
from moebus.kernels.lm_head_argmax import pack_panels
from moebus.kernels.paged_attention import cpu_kernel_available
from moebus.kernels.panel_linear import _CPU_ARGTYPES, panel_linear_cpu, panel_linear_ref

pytestmark = [pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels"),
              pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the kernel needs AVX512-BF16")]
ROWS = [1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 17, 31, 40, 64, 129]


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    return w, pack_panels(w)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", [(48, 64), (144, 96), (16, 32)])  # 3, 9 and 1 panels: wide tiles' leftovers
def test_matches_float64_and_f_linear(rows, n, k, close_bf16):
    w, panels = _weights(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    out = panel_linear_cpu(x, panels, n, k)
    assert out is not None and out.shape == (rows, n) and out.dtype == torch.bfloat16
    close_bf16(out, x.double() @ w.double().T)
    close_bf16(out, panel_linear_ref(x, w))


def test_bias_and_strided_rows(close_bf16):
    n, k = 64, 128
    w, panels = _weights(n, k)
    wide = torch.randn(21, k + 32).bfloat16()
    x = wide[:, 16:16 + k]  # rows k + 32 apart
    assert x.stride(0) == k + 32
    bias = torch.randn(n).bfloat16()
    out = panel_linear_cpu(x, panels, n, k, bias)
    close_bf16(out, x.double() @ w.double().T + bias.double())
    close_bf16(out, panel_linear_ref(x, w, bias))


def test_a_rows_result_does_not_depend_on_the_other_rows():
    n, k = 96, 192
    w, panels = _weights(n, k)
    x = torch.randn(37, k).bfloat16()
    whole = panel_linear_cpu(x, panels, n, k)
    for i in (0, 8, 16, 36):
        assert torch.equal(panel_linear_cpu(x[i:i + 1], panels, n, k)[0], whole[i])
        assert torch.equal(panel_linear_cpu(x[i:i + 5], panels, n, k)[0], whole[i])


def test_declines_what_it_does_not_cover():
    w, panels = _weights(48, 64)
    x = torch.randn(3, 64).bfloat16()
    assert panel_linear_cpu(x.float(), panels.float(), 48, 64) is None  # bf16 only
    assert panel_linear_cpu(x[:, :40], pack_panels(w[:, :40]), 48, 40) is None  # k not whole 32s
    assert panel_linear_cpu(x, pack_panels(w[:40]), 40, 64) is None  # n not whole panels
    assert panel_linear_cpu(x.t().contiguous().t(), panels, 48, 64) is None  # columns strided


def test_a_build_without_avx512_bf16_declines(rebuilt):
    lib = rebuilt("panel_linear_cpu.c", ["-mno-avx512bf16"], "no_bf16")
    fn = lib.panel_linear_bf16
    fn.argtypes, fn.restype = _CPU_ARGTYPES, ctypes.c_int
    w, panels = _weights(48, 64)
    x = torch.randn(3, 64).bfloat16()
    out = torch.empty(3, 48, dtype=torch.bfloat16)
    assert fn(x.data_ptr(), 64, panels.data_ptr(), None, 3, 48, 64, out.data_ptr(), 48) == 1


@pytest.fixture
def close_bf16(close):
    return lambda a, e: close(a, e, 1e-2, 1.6e-2)
