"""GGUF weight-only quantized linear (kernels/quant_matmul.py): the torch dequantize against
gguf-py's (bitwise), and the reference, C and Triton kernels against a float64 GEMM on the
dequantized weight, for Q4_0, Q4_1 and Q8_0 on odd shapes (K blocks not a multiple of 8, rows
not a multiple of the C kernel's 4-row and 16-row tiles), both C paths."""
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from moebus.kernels.quant_matmul import (
    BLOCK_BYTES,
    CPU_TILED_MIN_ROWS,
    cpu_kernel_available,
    dequantize_ref,
    quant_matmul,
    quant_matmul_cpu,
    quant_matmul_ref,
    quant_matmul_triton,
)

QTYPES = pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
SHAPES = [(1, 32, 7), (3, 160, 37), (4, 96, 16), (17, 288, 33), (65, 544, 129)]  # (M, K, N)
NEEDS_CC = pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")
# float32 sums of K products of |x| ~ 1 and |w| ~ 1 in any order: well inside 1e-4 at K <= 544.
TOL = {"atol": 1e-4, "rtol": 1e-5}


def _weight(n: int, k: int, qtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (1 + torch.rand(n, 1, generator=g))  # per-row scales differ
    return torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[qtype]))


def _case(m: int, k: int, n: int, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x with strided rows, the quantized w, and the float64 expectation."""
    w = _weight(n, k, qtype, m * 7 + k + n)
    x = torch.randn(m, k + 3, generator=torch.Generator().manual_seed(k))[:, :k]
    dense = torch.from_numpy(dequantize(w.numpy(), GGMLQuantizationType[qtype])).double()
    return x, w, x.double() @ dense.t()


@QTYPES
def test_dequantize_matches_gguf_bitwise(qtype):
    w = _weight(9, 224, qtype, 0)
    assert w.shape == (9, 224 // 32 * BLOCK_BYTES[qtype])
    expected = torch.from_numpy(dequantize(w.numpy(), GGMLQuantizationType[qtype]))
    assert torch.equal(dequantize_ref(w, qtype, 224), expected)


@QTYPES
@pytest.mark.parametrize("shape", SHAPES)
def test_ref_matches_float64(shape, qtype, close):
    x, w, expected = _case(*shape, qtype)
    close(quant_matmul_ref(x, w, qtype), expected, **TOL)


@NEEDS_CC
@QTYPES
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("one_path", [False, True], ids=["by-rows", "direct-only"])
def test_cpu_matches_float64(shape, qtype, one_path, close):
    x, w, expected = _case(*shape, qtype)
    out = quant_matmul_cpu(x, w, qtype, one_path=one_path)
    assert out is not None and out.dtype == torch.float32 and out.shape == expected.shape
    close(out, expected, **TOL)


@NEEDS_CC
@QTYPES
def test_cpu_large_call_takes_the_threaded_paths(qtype, close):
    x, w, expected = _case(CPU_TILED_MIN_ROWS + 1, 576, 1000, qtype)  # >= 262144 MACs: OpenMP on
    close(quant_matmul_cpu(x, w, qtype), expected, **TOL)
    close(quant_matmul_cpu(x[:1], w, qtype), expected[:1], **TOL)


@NEEDS_CC
@QTYPES
def test_cpu_rows_are_batch_invariant_on_one_path(qtype):
    """one_path (deterministic mode): a row's result is bitwise the same alone or in any batch."""
    x, w, _ = _case(11, 192, 50, qtype)
    together = quant_matmul_cpu(x, w, qtype, one_path=True)
    alone = torch.cat([quant_matmul_cpu(x[i:i + 1], w, qtype, one_path=True) for i in range(11)])
    assert torch.equal(together, alone)


@QTYPES
def test_dispatch_on_other_dtypes_computes_in_float32(qtype, close):
    x, w, expected = _case(5, 96, 20, qtype)
    out = quant_matmul(x.to(torch.bfloat16), w, qtype)
    assert out.dtype == torch.bfloat16
    close(out, x.to(torch.bfloat16).double() @ dequantize_ref(w, qtype, 96).double().t(), atol=0.1, rtol=2e-2)


def test_bad_weights_are_refused():
    w = _weight(4, 64, "Q4_1", 0)
    with pytest.raises(AssertionError, match="unsupported quant type"):
        quant_matmul_ref(torch.randn(2, 64), w, "Q5_K")
    with pytest.raises(AssertionError):
        quant_matmul(torch.randn(2, 64), w, "Q8_0")  # Q4_1 bytes read as Q8_0: wrong row length
    assert quant_matmul_cpu(torch.randn(2, 64).double(), w, "Q4_1") is None  # the reference takes it


@QTYPES
@pytest.mark.parametrize("shape", [(1, 32, 7), (17, 96, 33)])
def test_triton_matches_float64(shape, qtype, triton_device, close):
    x, w, expected = _case(*shape, qtype)
    out = quant_matmul_triton(x.contiguous().to(triton_device), w.to(triton_device), qtype)
    close(out, expected, **TOL)
