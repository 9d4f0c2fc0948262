"""LM head fused with greedy argmax, and its float32 logits (kernels/lm_head_argmax.py): reference,
Triton and C against a float64 loop, on shapes that hit every edge of the C kernel's tiles (rows not a multiple of 6,
vocab not a multiple of 16, K not a multiple of 8) and on the hard rows: ties, NaN, all -inf."""
import ctypes

import pytest
import torch

from moebus.kernels import cpu_build
from moebus.kernels.lm_head_argmax import (
    _CPU_ARGTYPES,
    ISAS,
    isas,
    lm_head_argmax,
    lm_head_argmax_cpu,
    lm_head_argmax_ref,
    lm_head_argmax_triton,
    lm_head_logits,
    lm_head_logits_cpu,
    pack_panels,
)
from moebus.kernels.paged_attention import cpu_kernel_available

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
SHAPES = [(1, 8, 16), (5, 13, 37), (7, 40, 1001), (13, 64, 300)]  # (M, K, N)
NEEDS_CC = pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")


def _cases(m: int, k: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer-valued inputs: every product and partial sum is exact in float32 (|dot| <= 9K), so
    whatever the summation order each float32 logit is the same exact value and every
    implementation must give exactly the naive index. The last column copies row 0's first
    maximum: a tie that the lower index wins (for every row holding it as its maximum)."""
    g = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    x = torch.randint(-3, 4, (m, k + 2), generator=g).float()[:, :k]  # strided rows
    w = torch.randint(-3, 4, (n, k), generator=g).float()
    w[n - 1] = w[int((x[0] @ w.t()).argmax())]
    return x.to(dtype), w.to(dtype)


def naive(x: torch.Tensor, w: torch.Tensor, special: dict[int, str] | None = None) -> torch.Tensor:
    logits = x.double() @ w.double().t()  # float32 logits, never rounded to the storage dtype
    out = []
    for row in logits.tolist():
        nans = [i for i, v in enumerate(row) if v != v]
        out.append(nans[0] if nans else row.index(max(row)))
    return torch.tensor(out)


def _with_specials(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 1 sees a NaN (x row NaN on one k; w column 4 inf times 0 -> NaN) and row 2 all -inf."""
    x, w = x.clone(), w.clone()
    if x.shape[0] >= 3 and w.shape[0] >= 6:
        x[1] = 0
        x[1, 0] = 1
        w[4, 0] = float("nan")  # only column 4 is NaN for row 1
        w[:, 1] = 1
        x[2] = 0
        x[2, 1] = float("-inf")  # every column: -inf * 1 (plus 0 * NaN in column 4 -> NaN)
    return x, w


@DTYPES
@pytest.mark.parametrize("shape", SHAPES)
def test_ref_matches_naive(shape, dtype):
    x, w = _cases(*shape, dtype)
    assert torch.equal(lm_head_argmax_ref(x, w), naive(x, w))


@DTYPES
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_naive(shape, dtype, triton_device):
    x, w = _cases(*shape, dtype)
    assert torch.equal(lm_head_argmax_triton(x.contiguous().to(triton_device), w.to(triton_device)).cpu(),
                       naive(x, w))


@NEEDS_CC
@DTYPES
@pytest.mark.parametrize("shape", [*SHAPES, (64, 128, 4099)])  # the last one takes the OpenMP path
def test_cpu_matches_naive(shape, dtype):
    x, w = _cases(*shape, dtype)
    out = lm_head_argmax_cpu(x, w)
    assert out is not None and out.dtype == torch.int64
    assert torch.equal(out, naive(x, w))
    assert torch.equal(lm_head_argmax(x, w, pack_panels(w)), out)


@NEEDS_CC
@DTYPES
def test_cpu_nan_and_all_neg_inf_rows(dtype):
    x, w = _with_specials(*_cases(7, 40, 1001, dtype))
    expected = naive(x, w)
    assert expected[1] == 4 and expected[2] == 4  # NaN wins over every number, -inf included
    assert torch.equal(lm_head_argmax_cpu(x, w), expected)
    assert torch.equal(lm_head_argmax_ref(x, w), expected)
    x[2, 1], w[4, 0] = float("-inf"), 0.0  # no NaN left: row 2 is all -inf -> the first index
    assert lm_head_argmax_cpu(x, w)[2] == 0 == naive(x, w)[2]


@NEEDS_CC
def test_cpu_random_floats_match_the_logits_path():
    """Float inputs: summation orders differ, so compare only rows without a near-tie."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 96, generator=g), torch.randn(5000, 96, generator=g)
    logits = x.double() @ w.double().t()
    top2 = logits.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert clear.sum() > 30
    out = lm_head_argmax_cpu(x, w, pack_panels(w))
    assert torch.equal(out[clear], logits.argmax(dim=1)[clear])


@NEEDS_CC
def test_cpu_rows_are_batch_invariant():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(23, 64, generator=g), torch.randn(777, 64, generator=g)
    panels = pack_panels(w)
    together = lm_head_argmax_cpu(x, w, panels)
    alone = torch.cat([lm_head_argmax_cpu(x[i:i + 1], w, panels) for i in range(x.shape[0])])
    assert torch.equal(together, alone)


def test_pack_panels_layout():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    p = pack_panels(w)
    assert p.shape == (2, 3, 16)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 3], w[19])
    assert torch.equal(p[1, :, 4:], torch.zeros(3, 12))  # padding past N


PATHS = pytest.mark.parametrize("isa", [i for i in ISAS if i != "auto"])


def _needs(isa: str, dtype: torch.dtype = torch.bfloat16) -> None:
    if isa not in isas(dtype):
        pytest.skip(f"no {isa} path for {dtype} on this CPU / build")


@NEEDS_CC
@PATHS
@pytest.mark.parametrize("shape", [*SHAPES, (64, 128, 4099), (45, 70, 33), (33, 576, 4112)])
def test_cpu_bf16_paths_match_naive(shape, isa):
    """Each bf16 path on the k-pair panels (AMX: rows in blocks of 32 and panels in pairs, so odd
    counts of both; K not a multiple of 32 runs on the zero padding)."""
    _needs(isa)
    x, w = _cases(*shape, torch.bfloat16)
    assert torch.equal(lm_head_argmax_cpu(x, w, pack_panels(w), isa=isa), naive(x, w))


@NEEDS_CC
@PATHS
def test_cpu_bf16_paths_nan_and_all_neg_inf_rows(isa):
    _needs(isa)
    x, w = _with_specials(*_cases(7, 40, 1001, torch.bfloat16))
    assert torch.equal(lm_head_argmax_cpu(x, w, isa=isa), naive(x, w))


@NEEDS_CC
@PATHS
def test_cpu_bf16_paths_are_batch_invariant_and_near_the_logits(isa):
    _needs(isa)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(40, 96, generator=g).bfloat16(), torch.randn(3000, 96, generator=g).bfloat16()
    panels = pack_panels(w)
    together = lm_head_argmax_cpu(x, w, panels, isa=isa)
    alone = torch.cat([lm_head_argmax_cpu(x[i:i + 1], w, panels, isa=isa) for i in range(x.shape[0])])
    assert torch.equal(together, alone)
    logits = x.double() @ w.double().t()  # the chosen logit is a maximum up to float32 summation order
    assert (logits.max(dim=1).values - logits.gather(1, together[:, None])[:, 0]).abs().max() <= 1e-4


@NEEDS_CC
@PATHS
@pytest.mark.parametrize("shape", [(1, 576, 1000), (13, 64, 300), (45, 70, 33), (64, 128, 4099)])
def test_cpu_bf16_paths_logits_are_float32_sums(shape, isa):
    """lm_head_logits on each path: the float32 sums of the bf16 products (not rounded to bf16),
    equal on integer inputs, within float32 rounding on random ones, and batch invariant."""
    _needs(isa)
    x, w = _cases(*shape, torch.bfloat16)
    got = lm_head_logits_cpu(x, w, pack_panels(w), isa=isa)
    assert got.dtype == torch.float32 and torch.equal(got.double(), x.double() @ w.double().t())
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(shape[0], shape[1], generator=g).bfloat16(), torch.randn(shape[2], shape[1], generator=g).bfloat16()
    panels = pack_panels(w)
    got = lm_head_logits_cpu(x, w, panels, isa=isa)
    assert (got.double() - x.double() @ w.double().t()).abs().max() < 1e-4
    alone = torch.cat([lm_head_logits_cpu(x[i:i + 1], w, panels, isa=isa) for i in range(x.shape[0])])
    assert torch.equal(got, alone)


@NEEDS_CC
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_cpu_logits_of_other_dtypes_are_float32(dtype):
    x, w = _cases(7, 40, 1001, dtype)
    got = lm_head_logits(x, w)
    assert got.dtype == torch.float32 and torch.equal(got.double(), x.double() @ w.double().t())


@NEEDS_CC
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("isa", ["fma", "fma256"])
@pytest.mark.parametrize("shape", [*SHAPES, (64, 128, 4099), (45, 70, 33)])
def test_cpu_fma_paths_match_naive(shape, isa, dtype):
    """fp32/fp16: AVX-512 tiles of 12 rows ("fma" where built) and the AVX2 tiles of 6 ("fma256")."""
    _needs(isa, dtype)
    plain = _cases(*shape, dtype)
    for x, w in (plain, _with_specials(*plain)):
        assert torch.equal(lm_head_argmax_cpu(x, w, pack_panels(w), isa=isa), naive(x, w))


def test_cpu_bf16_only_paths_decline_other_dtypes():
    assert "amx" not in isas(torch.float32) and "avx512_bf16" not in isas(torch.float16)


# The C kernels here build with -march=native (AMX, AVX-512); these rebuild the source without the
# paths an AVX2-only or a pre-AVX2 CPU lacks, so that their tiles are checked on this machine too.
NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16"]
FALLBACK_BUILDS = {"avx2": [*cpu_build.NO_AVX512, *NO_AMX], "scalar": [*cpu_build.SCALAR, *NO_AMX]}


@pytest.fixture(scope="module", params=sorted(FALLBACK_BUILDS))
def fallback_lib(request, rebuilt):
    return rebuilt("lm_head_argmax_cpu.c", FALLBACK_BUILDS[request.param], request.param)


@DTYPES
@pytest.mark.parametrize("shape", [*SHAPES, (45, 70, 33)])
def test_fallback_builds_match_naive(fallback_lib, shape, dtype):
    assert fallback_lib.lm_head_argmax_isas(1) == (1 << ISAS["fma"]) | (1 << ISAS["fma256"])  # no AMX, no vdpbf16ps
    fn = getattr(fallback_lib, f"lm_head_argmax_{cpu_build.DTYPE_SUFFIX[dtype]}")
    fn.argtypes, fn.restype = _CPU_ARGTYPES, ctypes.c_int
    plain = _cases(*shape, dtype)
    for x, w in (plain, _with_specials(*plain)):  # the specials' NaN column is most rows' answer
        panels = pack_panels(w)
        for isa in ("auto", "fma256"):
            out = torch.empty(x.shape[0], dtype=torch.int64)
            assert fn(x.data_ptr(), x.stride(0), panels.data_ptr(), x.shape[0], w.shape[0], w.shape[1], ISAS[isa],
                      out.data_ptr()) == 0
            assert torch.equal(out, naive(x, w))


def test_pack_panels_bf16_layout():
    w = torch.arange(20 * 35, dtype=torch.float32).view(20, 35).bfloat16()
    p = pack_panels(w)
    assert p.shape == (2, 32, 32)  # K 35 -> 64 in pairs
    assert torch.equal(p[0, :, 10:12].reshape(-1)[:35], w[5]) and torch.equal(p[1, :, 6:8].reshape(-1)[:35], w[19])
    assert not p[1, :, 8:].any() and not p[:, 18:].any()  # padding past N and past K


def test_cpu_declines_what_it_cannot_take():
    w = torch.randn(10, 4)
    assert lm_head_argmax_cpu(torch.randn(2, 4).double(), w.double()) is None
    assert lm_head_argmax_cpu(torch.randn(2, 5), w) is None  # K mismatch
    assert lm_head_argmax_cpu(torch.randn(4, 2).t(), w) is None  # rows not contiguous in K
    x = torch.randn(3, 4).double()
    assert torch.equal(lm_head_argmax(x, w.double()), naive(x, w.double()))  # the reference takes it
