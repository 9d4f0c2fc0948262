"""The batch-1 C step (kernels/decode_stack.py) of a bf16 model against decode_stack_ref: bf16
linear layers and experts on pack_panels panels (vdpbf16ps), bf16 caches and embedding, every value
rounded to bf16 where the module path holds a bf16 tensor, the MoE decoders' knobs; and a build
without AVX-512 refusing such a model."""
import pytest
import torch
from test_decode_stack import assert_same_step  # tests/kernels is on sys.path (no package)

from moebus.kernels import cpu_build
from moebus.kernels.decode_stack import (
    BF16,
    DecodeStack,
    StackExperts,
    StackLayer,
    StackLinear,
    StackShape,
    bf16_available,
    cpu_kernel_available,
    decode_stack_ref,
)
from moebus.kernels.fused_moe import pack_expert_panels
from moebus.kernels.lm_head_argmax import pack_panels

pytestmark = pytest.mark.skipif(not (cpu_kernel_available() and bf16_available()),
                                reason="no C compiler or no AVX512-BF16")

HIDDEN, INTER, NH, NKV, HD, E, K, BS = 64, 96, 4, 2, 32, 20, 3, 4
# The same bits but where the reference reduces in another order (torch's mean for the norms, its
# attention and softmax; the step runs the module path's kernels): a value there can land on the
# other side of a bf16 rounding boundary (2^-8 relative), which the bf16 residual then carries on.
# Measured on these cases: the residual stream equal, the final norm's output within 4.8e-7.
TOL = {"atol": 5e-2, "rtol": 1e-2}


def _linear(n: int, k: int, g: torch.Generator) -> StackLinear:
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    return StackLinear(w, k, panels=pack_panels(w))


def _experts(renorm: bool, scale: float, g: torch.Generator) -> StackExperts:
    router = torch.randn(E, HIDDEN, generator=g)
    w13 = (torch.randn(E, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(E, HIDDEN, INTER, generator=g) / INTER**0.5).bfloat16()
    return StackExperts(router, pack_panels(router), K, renorm, scale, BF16, pack_expert_panels(w13),
                        pack_expert_panels(w2), INTER)


def _layer(moe: bool, g: torch.Generator, qk_norm: str = "none", **kw) -> StackLayer:
    norms = {"none": (None, None), "head": (HD, HD), "full": (NH * HD, NKV * HD)}[qk_norm]
    qn, kn = (None if n is None else 1 + 0.2 * torch.randn(n, generator=g) for n in norms)
    mlp = (None, None) if moe else (_linear(2 * INTER, HIDDEN, g), _linear(HIDDEN, INTER, g))
    renorm, route_scale = kw.pop("renorm", True), kw.pop("route_scale", 1.0)
    return StackLayer(1 + 0.1 * torch.randn(HIDDEN, generator=g), 1 + 0.1 * torch.randn(HIDDEN, generator=g),
                      _linear((NH + 2 * NKV) * HD, HIDDEN, g), _linear(HIDDEN, NH * HD, g), *mlp,
                      q_norm=qn, k_norm=kn, qk_norm=qk_norm,
                      experts=_experts(renorm, route_scale, g) if moe else None, **kw)


def _caches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(6, BS, NKV, HD, generator=g).bfloat16() for _ in range(2)) for _ in range(n)]


VARIANTS = {
    "qwen3": dict(qk_norm="head"),
    "olmoe": dict(qk_norm="full", clip=0.8, renorm=False),
    "granite": dict(o_scale=0.22, route_scale=0.22),
    "mixtral": dict(),
}
SHAPE = StackShape(NH, NKV, HD, 1e-5, 10000.0, 64)


def _args(pos: int) -> tuple:
    table = torch.tensor([5, 2, 0, 4, 1, 3], dtype=torch.int32)
    return table, int(table[pos // BS]) * BS + pos % BS


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("pos", [0, 3, 9])
def test_bf16_step_matches_reference(variant, pos):
    g = torch.Generator().manual_seed(7)
    layers = [_layer(moe=i != 1, g=g, **dict(VARIANTS[variant])) for i in range(3)]  # MoE, dense, MoE
    scale = 0.1 if variant == "granite" else None
    norm = 1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))
    table, slot = _args(pos)
    h0 = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(pos))
    ref_caches, caches = _caches(pos, 3), _caches(pos, 3)
    want = decode_stack_ref(layers, norm, SHAPE, h0, pos, slot, pos + 1, table, ref_caches, scale)
    h = h0.clone()
    out = DecodeStack(layers, norm, SHAPE, scale=scale, dtype=torch.bfloat16).step(h, pos, slot, pos + 1, table,
                                                                                    caches)
    assert_same_step((out, h, caches), (*want, ref_caches), h0, TOL)
    keep = torch.ones(6 * BS, dtype=torch.bool)
    keep[slot] = False
    for got, ref in zip(sum(caches, ()), sum(ref_caches, ()), strict=True):  # the other slots, bit for bit
        assert torch.equal(got.view(-1, NKV, HD)[keep], ref.view(-1, NKV, HD)[keep])


def test_bf16_embedding_rows_are_looked_up():
    g = torch.Generator().manual_seed(3)
    layers = [_layer(True, g), _layer(False, g)]
    embed = torch.randn(30, HIDDEN, generator=g).bfloat16()
    stack = DecodeStack(layers, torch.ones(HIDDEN), SHAPE, embed=embed, emb_scale=3.0, dtype=torch.bfloat16)
    table, slot = _args(5)
    got = stack.step_ids(torch.tensor([4]), torch.tensor([5]), torch.tensor([slot]), 6, table[None], _caches(0, 2))
    want = stack.step(embed[4].float() * 3.0, 5, slot, 6, table, _caches(0, 2))
    assert got is not None and torch.equal(got, want)


def test_a_build_without_avx512_refuses_bf16(tmp_path):
    lib = cpu_build.build_variant("decode_stack_cpu.c", cpu_build.NO_AVX512, tmp_path)
    assert not bf16_available(lib)
    g = torch.Generator().manual_seed(9)
    stack = DecodeStack([_layer(True, g)], torch.ones(HIDDEN), SHAPE, lib=lib, dtype=torch.bfloat16)
    table, slot = _args(9)
    assert stack.step(torch.randn(HIDDEN), 9, slot, 10, table, _caches(0, 1)) is None
