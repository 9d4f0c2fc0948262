"""kernels/qmoe.py: the fused MoE on GGUF-quantized expert panels. Against qmoe_ref (per-expert
quant_matmul_qa_ref, float64 block sums), a token's bits the same alone and in a batch, the same
bits from a build without AVX-512, and a bad expert id named."""
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from moebus.kernels.cpu_build import NO_AVX512, build_variant
from moebus.kernels.qmoe import available, pack_experts, qmoe_cpu, qmoe_ref

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler")

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _experts(qtype: str, e: int, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e * n, k, generator=g) * torch.rand(e * n, 1, generator=g) / k**0.5
    return torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[qtype])).view(e, n, -1)


def _layer(qtype: str, e: int, d: int, i: int, seed: int = 0):
    w13, w2 = _experts(qtype, e, 2 * i, d, seed), _experts(qtype, e, d, i, seed + 1)
    return w13, w2, pack_experts(w13, qtype, d), pack_experts(w2, qtype, i)


def _routing(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return torch.softmax(torch.randn(t, k, generator=g), -1), ids


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("t,e,k,d,i", [(1, 8, 2, 64, 96), (7, 8, 2, 128, 64), (13, 16, 4, 96, 160)])
def test_matches_the_reference(qtype, t, e, k, d, i):
    w13, w2, p13, p2 = _layer(qtype, e, d, i, seed=t + d)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(i)) * 2
    weights, ids = _routing(t, e, k, seed=e)
    out, ref = qmoe_cpu(x, p13, p2, qtype, weights, ids, i), qmoe_ref(x, w13, w2, qtype, weights, ids)
    assert ref.abs().max() > 1e-2  # real products
    # float32 sums (and fast_exp in SiLU) vs float64: relative to the output's scale
    assert (out - ref).abs().max() <= 2e-5 * ref.abs().max(), ((out - ref).abs().max(), ref.abs().max())


@pytest.mark.parametrize("q13,q2", [("Q4_1", "Q8_0"), ("Q8_0", "Q4_0")])
def test_gate_up_and_down_in_different_types(q13, q2):
    """A Q4_K_M file's experts as served: gate|up Q4_K as Q4_1 blocks, down Q6_K as Q8_0."""
    t, e, k, d, i = 9, 8, 2, 128, 96
    w13, w2 = _experts(q13, e, 2 * i, d, 11), _experts(q2, e, d, i, 12)
    p13, p2 = pack_experts(w13, q13, d), pack_experts(w2, q2, i)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(4)) * 2
    weights, ids = _routing(t, e, k, seed=5)
    out = qmoe_cpu(x, p13, p2, q13, weights, ids, i, qtype2=q2)
    ref = qmoe_ref(x, w13, w2, q13, weights, ids, qtype2=q2)
    assert ref.abs().max() > 1e-2
    assert (out - ref).abs().max() <= 2e-5 * ref.abs().max(), ((out - ref).abs().max(), ref.abs().max())
    # without qtype2 the down panels are taken as gate|up's type, whose size they do not have: refused
    with pytest.raises(AssertionError):
        qmoe_cpu(x, p13, p2, q13, weights, ids, i)


def test_swiglu_limit_matches_the_reference():
    w13, w2, p13, p2 = _layer("Q8_0", 4, 64, 64, seed=3)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)) * 8
    weights, ids = _routing(5, 4, 2, seed=1)
    out = qmoe_cpu(x, p13, p2, "Q8_0", weights, ids, 64, swiglu_limit=0.5)
    ref = qmoe_ref(x, w13, w2, "Q8_0", weights, ids, swiglu_limit=0.5)
    assert (out - ref).abs().max() <= 2e-5 * ref.abs().max()
    assert not torch.allclose(out, qmoe_cpu(x, p13, p2, "Q8_0", weights, ids, 64), atol=1e-3)  # the clamp bites


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_tokens_bits_do_not_depend_on_the_batch(qtype):
    _, _, p13, p2 = _layer(qtype, 8, 128, 96, seed=5)
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(6))
    weights, ids = _routing(37, 8, 3, seed=7)
    many = qmoe_cpu(x, p13, p2, qtype, weights, ids, 96)
    for rows in (slice(0, 1), slice(5, 7), slice(9, 12), slice(36, 37)):
        assert torch.equal(qmoe_cpu(x[rows], p13, p2, qtype, weights[rows], ids[rows], 96), many[rows]), rows


def test_a_build_without_avx512_gives_the_same_bits(tmp_path):
    lib = build_variant("qmoe_cpu.c", NO_AVX512, tmp_path)
    assert lib is not None
    for qtype in QTYPES:
        _, _, p13, p2 = _layer(qtype, 4, 64, 96, seed=9)
        x = torch.randn(6, 64, generator=torch.Generator().manual_seed(8))
        weights, ids = _routing(6, 4, 2, seed=3)
        plain = qmoe_cpu(x, p13, p2, qtype, weights, ids, 96, lib=lib)
        assert torch.equal(plain, qmoe_cpu(x, p13, p2, qtype, weights, ids, 96)), qtype


def test_an_expert_id_out_of_range_is_named():
    _, _, p13, p2 = _layer("Q4_0", 4, 64, 64)
    with pytest.raises(IndexError, match=r"outside \[0, 4\)"):
        qmoe_cpu(torch.randn(2, 64), p13, p2, "Q4_0", torch.ones(2, 1), torch.tensor([[1], [4]]), 64)
