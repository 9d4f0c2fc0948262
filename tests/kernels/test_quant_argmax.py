"""Greedy tokens from a GGUF-block head (kernels/quant_argmax.py, csrc/quant_argmax_cpu.c): the C
kernel's token is exactly row argmax of the logits its GEMV kernels give (quant_dot_cpu.c for 8 /
16-bit activations, quant_matmul_cpu.c's direct path for float ones), and the torch reference's up
to a near-tie; ties resolve to the first index across chunks and threads, a NaN wins at its first
index; the AVX2-only and scalar builds agree with the reference too."""
import ctypes

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from moebus.kernels import cpu_build
from moebus.kernels.quant_argmax import (
    _ARGTYPES,
    cpu_function,
    quant_argmax_cpu,
    quant_argmax_cpu_unchecked,
    quant_argmax_ref,
)
from moebus.kernels.quant_matmul import (
    GGML_TYPES,
    quant_matmul_cpu,
    quant_matmul_qa_cpu,
    quant_matmul_qa_ref,
    quant_matmul_ref,
)

QTYPES = pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
BITS = pytest.mark.parametrize("bits", [None, 8, 16], ids=["float", "int8", "int16"])
# (M, K, N): one block and a tail chunk; rows above the 4-row register groups; the threaded call
# (>= 262144 MACs) over 4 chunks, the last partial
SHAPES = [(1, 32, 7), (5, 96, 300), (2, 576, 1000)]
NEEDS_CC = pytest.mark.skipif(cpu_function() is None, reason="no C compiler for the CPU kernels")


def _weight(n: int, k: int, qtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (1 + torch.rand(n, 1, generator=g))
    return torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[qtype]))


def _logits_cpu(x: torch.Tensor, w: torch.Tensor, qtype: str, bits: int | None) -> torch.Tensor:
    """The logits of the C GEMV the head's 1-3 row calls take (direct path for float activations)."""
    return quant_matmul_qa_cpu(x, w, qtype, bits) if bits else quant_matmul_cpu(x, w, qtype, one_path=True)


def _ref_logits(x: torch.Tensor, w: torch.Tensor, qtype: str, bits: int | None) -> torch.Tensor:
    return quant_matmul_qa_ref(x, w, qtype, bits) if bits else quant_matmul_ref(x, w, qtype)


def _within_near_tie(tokens: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> bool:
    """Each token's reference logit is the row maximum up to float32 summation order."""
    return bool((ref.gather(1, tokens[:, None])[:, 0] >= ref.max(dim=1).values - tol).all())


@NEEDS_CC
@QTYPES
@BITS
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_token_is_the_argmax_of_its_gemv_logits(shape, qtype, bits):
    m, k, n = shape
    w = _weight(n, k, qtype, m + k + n)
    x = torch.randn(m, k + 3)[:, :k]  # strided rows
    out = quant_argmax_cpu(x, w, qtype, bits)
    assert out is not None and out.dtype == torch.int64 and out.shape == (m,)
    assert torch.equal(out, _logits_cpu(x, w, qtype, bits).max(dim=1).indices)
    ref = _ref_logits(x, w, qtype, bits)
    assert _within_near_tie(out, ref)
    assert (out == quant_argmax_ref(x, w, qtype, bits)).float().mean() >= 0.5  # not a near-tie everywhere


@NEEDS_CC
def test_ties_take_the_first_index_and_nan_wins():
    qtype, k, n = "Q8_0", 576, 6000  # 24 chunks
    w = _weight(n, k, qtype, 1)
    x = torch.randn(1, k)
    best_row = torch.from_numpy(quantize((5 * x).numpy(), GGMLQuantizationType.Q8_0))[0]  # far above the rest
    for r in [*range(n - 50, 0, -256), 301]:  # identical rows, in every chunk and twice in one: the first wins
        w[r] = best_row
    for bits in (None, 8, 16):
        assert quant_argmax_ref(x, w, qtype, bits).tolist() == [62], bits
        assert quant_argmax_cpu(x, w, qtype, bits).tolist() == [62], bits
    assert quant_argmax_cpu(torch.zeros(1, k), w, qtype, 16).tolist() == [0]  # every logit 0: the first
    nan_half = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # f16 NaN as the block scale
    for r in (900, 800):
        w[r, :2] = nan_half
    for bits in (None, 8, 16):
        assert quant_argmax_cpu(x, w, qtype, bits).tolist() == [800], bits
        assert quant_argmax_ref(x, w, qtype, bits).tolist() == [800], bits


@NEEDS_CC
def test_rows_are_independent_and_bad_calls_refused():
    qtype, k, n = "Q4_1", 160, 700
    w = _weight(n, k, qtype, 2)
    x = torch.randn(6, k)
    together = quant_argmax_cpu(x, w, qtype, 16)
    assert torch.equal(together, torch.cat([quant_argmax_cpu(x[i:i + 1], w, qtype, 16) for i in range(6)]))
    assert quant_argmax_cpu(torch.randn(65, k), w, qtype, 16) is None  # above MAX_ROWS
    assert quant_argmax_cpu(x.double(), w, qtype, 16) is None
    assert quant_argmax_cpu(x, w, qtype, 4) is None
    out = torch.empty(1, dtype=torch.int64)
    assert cpu_function()(16, 7, x.data_ptr(), k, w.data_ptr(), w.stride(0), 1, n, k, out.data_ptr()) == 1  # type 7


# AVX2 without AVX-512 (the 8-lane dots), the same without VNNI, and no AVX2 at all: the paths a
# smaller CPU takes, checked against the reference up to a near-tie.
FALLBACK_BUILDS = {"avx2": cpu_build.NO_AVX512,
                   "avx2-no-vnni": [*cpu_build.NO_AVX512, "-mno-avxvnni", "-mno-avx512vnni"],
                   "scalar": cpu_build.SCALAR}


@pytest.fixture(scope="module", params=sorted(FALLBACK_BUILDS))
def fallback_fn(request, rebuilt):
    f = rebuilt("quant_argmax_cpu.c", FALLBACK_BUILDS[request.param], request.param).quant_argmax_f32
    f.argtypes, f.restype = _ARGTYPES, ctypes.c_int
    return f


@QTYPES
@BITS
def test_fallback_builds_match_the_reference(fallback_fn, qtype, bits):
    m, k, n = 3, 160, 600
    w = _weight(n, k, qtype, 3)
    x = torch.randn(m, k)
    out = quant_argmax_cpu_unchecked(fallback_fn, x, w, GGML_TYPES[qtype], bits)
    assert out is not None and _within_near_tie(out, _ref_logits(x, w, qtype, bits))
