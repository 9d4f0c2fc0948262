"""GGUF weight-only quantized linear (kernels/quant_matmul.py): the torch dequantize against
gguf-py's (bitwise), and the reference, C and Triton kernels against a float64 GEMM on the
dequantized weight, for Q4_0, Q4_1 and Q8_0 on odd shapes (K blocks not a multiple of 8, rows
not a multiple of the C kernel's 4-row and 16-row tiles), both C paths. The integer-activation
kernel (csrc/quant_dot_cpu.c, 8 and 16 bits) against its torch reference (the activation
quantization bit for bit, the products up to float32 summation order) and against float64 within
the activation's rounding bound."""
import ctypes

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from moebus.kernels import cpu_build
from moebus.kernels.quant_matmul import (
    _CPU_ARGTYPES,
    _QA_ARGTYPES,
    BLOCK_BYTES,
    CPU_TILED_MIN_ROWS,
    GGML_TYPES,
    cpu_kernel_available,
    dequantize_ref,
    quant_matmul,
    quant_matmul_cpu,
    quant_matmul_cpu_unchecked,
    quant_matmul_qa_cpu,
    quant_matmul_qa_cpu_unchecked,
    quant_matmul_qa_ref,
    quant_matmul_ref,
    quant_matmul_triton,
    quantize_act_cpu,
    quantize_act_ref,
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


BITS = pytest.mark.parametrize("bits", [8, 16])


def _qa_bound(x: torch.Tensor, w: torch.Tensor, qtype: str, bits: int) -> torch.Tensor:
    """|qa(x) . w - x . w| <= sum_k |w_k| |x_k - d q_k|, and |x_k - d q_k| <= d (1/2 + qmax 2^-22): round
    to nearest after x * (1 / d) rounded in float32 (relative 2^-23 twice); plus float32 sum slack."""
    _, d, _ = quantize_act_ref(x, bits)
    step = d.repeat_interleave(32, dim=1).double() * (0.5 + (2 ** (bits - 1) - 1) * 2.0**-22)  # [M, K]
    return step @ dequantize_ref(w, qtype, x.shape[1]).double().abs().t() + 1e-4


@NEEDS_CC
@BITS
def test_activation_quantization_matches_ref_bitwise(bits):
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(3))[:, :192] * 3
    x[1, 32:64] = 0  # d = 0: quants 0
    x[2, :32] = torch.arange(32) % 8 - 3.5  # halves: with max |x| = qmax (d = 1) they are ties
    x[2, 0] = 2 ** (bits - 1) - 1
    ours, ref = quantize_act_cpu(x, bits), quantize_act_ref(x, bits)
    assert ours is not None and all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    assert ref[0].abs().max() == 2 ** (bits - 1) - 1 and ref[1][1, 1] == 0 and ref[1][2, 0] == 1
    assert ref[0][2, 1:8].tolist() == [-2, -2, 0, 0, 2, 2, 4]  # ties to even


@NEEDS_CC
@BITS
@QTYPES
@pytest.mark.parametrize("shape", SHAPES)
def test_qa_cpu_matches_its_torch_reference(shape, qtype, bits, close):
    x, w, expected = _case(*shape, qtype)
    out, ref = quant_matmul_qa_cpu(x, w, qtype, bits), quant_matmul_qa_ref(x, w, qtype, bits)
    assert out is not None and out.shape == expected.shape
    close(out, ref, **TOL)  # the same integer dots and float32 terms, summed in another order
    err = (ref.double() - expected).abs()
    assert (err <= _qa_bound(x, w, qtype, bits)).all()
    if bits == 8:
        assert err.max() > 1e-3  # the activation really is quantized: well outside the float path's TOL


@NEEDS_CC
@BITS
@QTYPES
def test_qa_cpu_threaded_and_row_independent(qtype, bits, close):
    x, w, expected = _case(3, 576, 1000, qtype)  # >= 262144 MACs: OpenMP on
    together = quant_matmul_qa_cpu(x, w, qtype, bits)
    assert (together.double() - expected).abs().le(_qa_bound(x, w, qtype, bits)).all()
    close(together, quant_matmul_qa_ref(x, w, qtype, bits), **TOL)
    alone = [quant_matmul_qa_cpu(x[i:i + 1], w, qtype, bits) for i in range(3)]
    assert torch.equal(together, torch.cat(alone))


# The build the C kernels get here is -march=native; these rebuild the sources without the paths a
# CPU may lack, so that those a smaller CPU takes stay tested: AVX2 without AVX-512 (the 8-lane
# 16-bit dots; on an AVX-512 CPU the default build takes qa_block512), the same without VNNI either
# (maddubs + madd for the 8-bit dots, where the default build uses dpbusd), and no AVX2 at all.
FALLBACK_BUILDS = {"avx2": cpu_build.NO_AVX512,
                   "avx2-no-vnni": [*cpu_build.NO_AVX512, "-mno-avxvnni", "-mno-avx512vnni"],
                   "scalar": cpu_build.SCALAR}


@pytest.fixture(scope="module", params=sorted(FALLBACK_BUILDS))
def fallback_libs(request, rebuilt):
    libs = []
    for source, fn, argtypes in (("quant_dot_cpu.c", "quant_matmul_qa_f32", _QA_ARGTYPES),
                                 ("quant_matmul_cpu.c", "quant_matmul_f32", _CPU_ARGTYPES)):
        f = getattr(rebuilt(source, FALLBACK_BUILDS[request.param], request.param), fn)
        f.argtypes, f.restype = argtypes, ctypes.c_int
        libs.append(f)
    return libs


@QTYPES
@pytest.mark.parametrize("shape", [(1, 96, 37), (3, 160, 16)])
def test_fallback_builds_match_their_references(fallback_libs, shape, qtype, close):
    qa_fn, float_fn = fallback_libs
    x, w, _ = _case(*shape, qtype)
    x = x.contiguous()
    for bits in (8, 16):
        close(quant_matmul_qa_cpu_unchecked(qa_fn, x, w, GGML_TYPES[qtype], bits),
              quant_matmul_qa_ref(x, w, qtype, bits), **TOL)
    close(quant_matmul_cpu_unchecked(float_fn, x, w, GGML_TYPES[qtype], True), quant_matmul_ref(x, w, qtype), **TOL)


@QTYPES
@pytest.mark.parametrize("shape", [(1, 32, 7), (17, 96, 33)])
def test_triton_matches_float64(shape, qtype, triton_device, close):
    x, w, expected = _case(*shape, qtype)
    out = quant_matmul_triton(x.contiguous().to(triton_device), w.to(triton_device), qtype)
    close(out, expected, **TOL)
