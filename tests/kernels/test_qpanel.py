"""kernels/qpanel.py: GGUF weights in 16-output panels on 16-bit activations. Against the reference
(quant_matmul_qa_ref: the same integer dots, blocks summed in float64), the SIMD tile against the
plain C tile bit for bit (in one build, and across a build without AVX-512), and a row's bits the
same whatever the call's row count (the property the engine's batch invariance rests on)."""
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from moebus.kernels.cpu_build import NO_AVX512, build_variant
from moebus.kernels.qpanel import (
    _MATMUL_ARGS,
    GGML_TYPES,
    matmul_function,
    pack_panels,
    panel_bytes,
    qpanel_matmul,
    simd_available,
)
from moebus.kernels.quant_matmul import quant_matmul_qa_ref

pytestmark = pytest.mark.skipif(matmul_function() is None, reason="no C compiler")

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _weight(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different scales
    return torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[qtype]))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(16, 32), (37, 64), (200, 576), (50, 1536)])
def test_matches_the_reference(qtype, n, k):
    w = _weight(qtype, n, k, n + k)
    panels = pack_panels(w, qtype, k)
    assert panels.numel() == panel_bytes(qtype, n, k)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(k)) * 3
    out, ref = qpanel_matmul(x, panels, qtype, n), quant_matmul_qa_ref(x, w, qtype, 16)
    # float32 block sums in block order vs float64: |error| ~ eps * sum |terms|
    scale = quant_matmul_qa_ref(x.abs(), w, qtype, 16).abs().max()
    assert (out - ref).abs().max() <= 4e-6 * scale, ((out - ref).abs().max(), scale)
    assert ref.abs().max() > 0.1  # real products


@pytest.mark.parametrize("qtype", QTYPES)
def test_simd_tile_gives_the_plain_tiles_bits(qtype):
    n, k = 83, 320  # a partial last panel
    w = _weight(qtype, n, k, 3)
    panels = pack_panels(w, qtype, k)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(4))
    x[3, 40:72] = 0  # an all-zero activation block (its scale 0)
    assert torch.equal(qpanel_matmul(x, panels, qtype, n), qpanel_matmul(x, panels, qtype, n, plain=True))


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_rows_bits_do_not_depend_on_the_row_count(qtype):
    n, k = 300, 576
    w = _weight(qtype, n, k, 5)
    panels = pack_panels(w, qtype, k)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(6))
    many = qpanel_matmul(x, panels, qtype, n)
    for rows in (slice(0, 1), slice(5, 7), slice(9, 12), slice(20, 24), slice(0, 37)):
        assert torch.equal(qpanel_matmul(x[rows], panels, qtype, n), many[rows]), rows
    assert torch.equal(qpanel_matmul(x[::2], panels, qtype, n), many[::2])  # a strided x


def test_a_build_without_avx512_gives_the_same_bits(tmp_path):
    """The plain C path a smaller CPU takes (checked here on whatever this CPU is)."""
    lib = build_variant("qpanel_cpu.c", NO_AVX512, tmp_path)
    assert lib is not None
    assert lib.qpanel_simd() == 0
    fn = lib.qpanel_matmul_f32
    fn.argtypes, fn.restype = _MATMUL_ARGS, int
    for qtype in QTYPES:
        n, k = 45, 96
        w = _weight(qtype, n, k, 7)
        panels = pack_panels(w, qtype, k)
        x = torch.randn(6, k, generator=torch.Generator().manual_seed(8))
        out = torch.empty(6, n)
        assert fn(GGML_TYPES[qtype], x.data_ptr(), k, panels.data_ptr(), 6, n, k, out.data_ptr(), n) == 0
        assert torch.equal(out, qpanel_matmul(x, panels, qtype, n)), qtype


def test_simd_is_taken_where_the_cpu_has_avx512():
    flags = open("/proc/cpuinfo").read()
    assert simd_available() == ("avx512bw" in flags and "avx512f" in flags)
