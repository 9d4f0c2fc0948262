"""Row argmax (kernels/argmax.py): reference, Triton and C against a float64 loop / each other."""
import pytest
import torch

from moebus.kernels import row_argmax, row_argmax_ref, row_argmax_triton
from moebus.kernels.argmax import row_argmax_cpu
from moebus.kernels.paged_attention import cpu_kernel_available

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
SHAPES = [(1, 1), (3, 17), (5, 513), (64, 4113)]  # odd widths, one past the C kernel's 512 block


def _cases(shape, dtype, device="cpu") -> torch.Tensor:
    """Random rows plus the hard ones: ties (first wins), NaN (first NaN wins), all -inf, a max in
    the last column."""
    b, n = shape
    x = torch.randn(b, n + 3, device=device)[:, :n].to(dtype)  # strided rows
    if n > 5 and b >= 5:
        x[0, 2] = x[0, n - 1] = 1e4  # tie: the first
        x[1, 4] = x[1, n - 2] = float("nan")
        x[2] = float("-inf")
        x[3, n - 1] = 1e4
        x[4, 3] = float("inf")
    return x


def naive(x: torch.Tensor) -> torch.Tensor:
    out = []
    for row in x.double().tolist():
        nans = [i for i, v in enumerate(row) if v != v]
        out.append(nans[0] if nans else row.index(max(row)))
    return torch.tensor(out)


@DTYPES
@pytest.mark.parametrize("shape", SHAPES)
def test_ref_matches_naive(shape, dtype):
    x = _cases(shape, dtype)
    assert torch.equal(row_argmax_ref(x), naive(x))


@DTYPES
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_naive(shape, dtype, triton_device):
    x = _cases(shape, dtype, triton_device)
    assert torch.equal(row_argmax_triton(x).cpu(), naive(x.cpu()))


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")
@DTYPES
@pytest.mark.parametrize("shape", [*SHAPES, (600, 300)])  # 600 rows: the OpenMP-parallel path
def test_cpu_matches_naive(shape, dtype):
    x = _cases(shape, dtype)
    out = row_argmax_cpu(x)
    assert out is not None and out.dtype == torch.int64
    assert torch.equal(out, naive(x))
    assert torch.equal(row_argmax(x), out)


def test_cpu_declines_what_it_cannot_take():
    assert row_argmax_cpu(torch.randn(2, 3, 4)) is None
    assert row_argmax_cpu(torch.randn(4, 6).double()) is None
    assert row_argmax_cpu(torch.randn(4, 6).t()) is None  # columns not contiguous
    x = torch.randn(4, 6).double()
    assert torch.equal(row_argmax(x), naive(x))  # the reference takes it
