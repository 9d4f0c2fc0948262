"""The batch-1 C step (kernels/decode_stack.py) with MoE decoder layers against decode_stack_ref:
routed experts on GGUF panels (kernels/qmoe.py) behind a float32 router (renormalised top-k, or top-k
of the full softmax, times a scale), q/k RMSNorm per head and over the projection, QKV clipping, a
softmax scale, an O scale, an embedding scale, and a dense layer between MoE ones; plus a build
without AVX-512 (the plain router and qpanel tiles)."""
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from test_decode_stack import assert_same_step  # tests/kernels is on sys.path (no package)

from moebus.kernels import cpu_build
from moebus.kernels.decode_stack import (
    DecodeStack,
    StackExperts,
    StackLayer,
    StackLinear,
    StackShape,
    cpu_kernel_available,
    decode_stack_ref,
)
from moebus.kernels.lm_head_argmax import pack_panels
from moebus.kernels.qmoe import pack_experts
from moebus.kernels.qpanel import pack_panels as pack_qpanels

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")

HIDDEN, INTER, NH, NKV, HD, E, K, BS = 64, 96, 4, 2, 32, 20, 3, 4  # 20 experts: a partial router panel
# float32 sums in other orders, and a reordered norm flipping one int16 rounding of an expert's
# input (d / 2, d ~ max|x| / 32767) that k experts' weights carry into h: measured up to 3.9e-4
TOL = {"atol": 1e-3, "rtol": 1e-4}


def _blocks(w: torch.Tensor, qtype: str) -> torch.Tensor:
    return torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[qtype])).view(*w.shape[:-1], -1)


def _qlinear(n: int, k: int, qtype: str, g: torch.Generator) -> StackLinear:
    b = _blocks(torch.randn(n, k, generator=g) / k**0.5, qtype)
    return StackLinear(b, k, qtype, 16, panels=pack_qpanels(b, qtype, k))


def _experts(qtype: str, renorm: bool, scale: float, g: torch.Generator) -> StackExperts:
    """qtype "A/B": gate|up in A, down in B (a Q4_K_M file's experts as served)."""
    q13, q2 = (qtype.split("/") + [qtype])[:2]
    router = torch.randn(E, HIDDEN, generator=g)
    w13 = _blocks(torch.randn(E, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5, q13)
    w2 = _blocks(torch.randn(E, HIDDEN, INTER, generator=g) / INTER**0.5, q2)
    return StackExperts(router, pack_panels(router), K, renorm, scale, q13, pack_experts(w13, q13, HIDDEN),
                        pack_experts(w2, q2, INTER), INTER, q2)


def _layer(moe: bool, qtype: str, g: torch.Generator, qk_norm: str = "none", **kw) -> StackLayer:
    norms = {"none": (None, None), "head": (HD, HD), "full": (NH * HD, NKV * HD)}[qk_norm]
    qn, kn = (None if n is None else 1 + 0.2 * torch.randn(n, generator=g) for n in norms)
    lin = qtype.split("/")[0]
    mlp = (None, None) if moe else (_qlinear(2 * INTER, HIDDEN, lin, g), _qlinear(HIDDEN, INTER, lin, g))
    renorm, route_scale = kw.pop("renorm", True), kw.pop("route_scale", 1.0)
    return StackLayer(1 + 0.1 * torch.randn(HIDDEN, generator=g), 1 + 0.1 * torch.randn(HIDDEN, generator=g),
                      _qlinear((NH + 2 * NKV) * HD, HIDDEN, lin, g), _qlinear(HIDDEN, NH * HD, lin, g), *mlp,
                      q_norm=qn, k_norm=kn, qk_norm=qk_norm,
                      experts=_experts(qtype, renorm, route_scale, g) if moe else None,
                      **kw)


def _caches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, BS, NKV, HD, generator=g), torch.randn(6, BS, NKV, HD, generator=g)) for _ in range(n)]


VARIANTS = {
    "qwen3": dict(qk_norm="head"),
    "olmoe": dict(qk_norm="full", clip=0.8, renorm=False),
    "granite": dict(o_scale=0.22, route_scale=0.22),
    "mixtral": dict(),
}


def _check(layers, shape, pos, scale, lib=None):
    norm = 1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))
    table = torch.tensor([5, 2, 0, 4, 1, 3], dtype=torch.int32)
    slot = int(table[pos // BS]) * BS + pos % BS
    h0 = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(pos))
    ref_caches, caches = _caches(pos, len(layers)), _caches(pos, len(layers))
    want_out, want_h = decode_stack_ref(layers, norm, shape, h0, pos, slot, pos + 1, table, ref_caches, scale)
    h = h0.clone()
    out = DecodeStack(layers, norm, shape, scale=scale, lib=lib).step(h, pos, slot, pos + 1, table, caches)
    assert_same_step((out, h, caches), (want_out, want_h, ref_caches), h0, TOL)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_1/Q8_0"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("pos", [0, 3, 9])
def test_moe_step_matches_reference(variant, qtype, pos):
    g = torch.Generator().manual_seed(7)
    layers = [_layer(moe=i != 1, qtype=qtype, g=g, **dict(VARIANTS[variant])) for i in range(3)]  # MoE, dense, MoE
    shape = StackShape(NH, NKV, HD, 1e-5, 10000.0, 64)
    _check(layers, shape, pos, scale=0.1 if variant == "granite" else None)


def test_embedding_scale_applies_to_the_looked_up_row():
    g = torch.Generator().manual_seed(3)
    layers = [_layer(True, "Q8_0", g)]
    shape = StackShape(NH, NKV, HD, 1e-5, 10000.0, 64)
    embed = torch.randn(30, HIDDEN, generator=g)
    table, pos = torch.tensor([[5, 2, 0, 4, 1, 3]], dtype=torch.int32), 5
    slot = int(table[0, pos // BS]) * BS + pos % BS
    scaled = DecodeStack(layers, torch.ones(HIDDEN), shape, embed=embed, emb_scale=12.0)
    plain = DecodeStack(layers, torch.ones(HIDDEN), shape, embed=embed)
    got = scaled.step_ids(torch.tensor([4]), torch.tensor([pos]), torch.tensor([slot]), pos + 1, table, _caches(0, 1))
    want = plain.step(embed[4] * 12.0, pos, slot, pos + 1, table[0], _caches(0, 1))
    assert torch.equal(got, want)


def test_a_build_without_avx512(tmp_path):
    lib = cpu_build.build_variant("decode_stack_cpu.c", cpu_build.NO_AVX512, tmp_path)
    g = torch.Generator().manual_seed(9)
    layers = [_layer(moe=True, qtype="Q8_0", g=g, **dict(VARIANTS["olmoe"])) for _ in range(2)]
    shape = StackShape(NH, NKV, HD, 1e-5, 10000.0, 64)
    _check(layers, shape, 9, None, lib=lib)
