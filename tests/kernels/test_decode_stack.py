"""The batch-1 decode step in one C call (kernels/decode_stack.py) against its torch reference
(decode_stack_ref: the kernels' references in the module path's order), on a small random stack:
float32, Q4_0, Q4_1 and Q8_0 weights on float and 8/16-bit integer activations, GQA, positions on
both sides of cache block boundaries; the hidden state out, the residual stream and the K/V rows
written into the cache."""
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from moebus.kernels import cpu_build
from moebus.kernels.decode_stack import (
    DecodeStack,
    StackLayer,
    StackLinear,
    StackShape,
    cpu_kernel_available,
    decode_stack_ref,
)

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")

HIDDEN, INTER, NH, NKV, HD, LAYERS, BS = 96, 160, 3, 1, 32, 2, 4
SHAPE = StackShape(NH, NKV, HD, 1e-5, 10000.0, 64)
# head dims: 32 takes the attention's plain weighted-V loop, 64 its register tiles (AVX2 builds)
HEAD_DIMS = pytest.mark.parametrize("hd", [HD, 64])
# float32 sums in another order through 2 layers (values ~1): ~1e-6; integer activations add the
# chance that a reordered norm flips one rounding of a quantized element (d / 2, d ~ max|x| / 32767).
TOL = {"atol": 2e-4, "rtol": 1e-4}


def _linear(n: int, k: int, qtype: str | None, bits: int | None, g: torch.Generator) -> StackLinear:
    w = torch.randn(n, k, generator=g) / k**0.5
    if qtype is None:
        return StackLinear(w, k)
    blocks = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[qtype]))
    return StackLinear(blocks, k, qtype, bits)


def _stack(qtype: str | None, bits: int | None, seed: int = 0, hd: int = HD) -> list[StackLayer]:
    g = torch.Generator().manual_seed(seed)
    return [StackLayer(1 + 0.1 * torch.randn(HIDDEN, generator=g), 1 + 0.1 * torch.randn(HIDDEN, generator=g),
                       _linear((NH + 2 * NKV) * hd, HIDDEN, qtype, bits, g), _linear(HIDDEN, NH * hd, qtype, bits, g),
                       _linear(2 * INTER, HIDDEN, qtype, bits, g), _linear(HIDDEN, INTER, qtype, bits, g))
            for _ in range(LAYERS)]


def _caches(seed: int, hd: int = HD) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, BS, NKV, hd, generator=g), torch.randn(6, BS, NKV, hd, generator=g))
            for _ in range(LAYERS)]


CASES = [(None, None), ("Q4_0", 16), ("Q4_1", 16), ("Q4_1", 8), ("Q8_0", None), ("Q8_0", 8), ("Q8_0", 16),
         ("Q4_1", None)]


@HEAD_DIMS
@pytest.mark.parametrize(("qtype", "bits"), CASES)
@pytest.mark.parametrize("pos", [0, 3, 4, 9, 19])  # first slot, last of a block, first of the next
def test_step_matches_reference(qtype, bits, pos, hd):
    shape = StackShape(NH, NKV, hd, SHAPE.eps, SHAPE.rope_theta, SHAPE.max_positions)
    layers = _stack(qtype, bits, hd=hd)
    norm = 1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))
    table = torch.tensor([5, 2, 0, 4, 1, 3], dtype=torch.int32)  # scattered pages
    slot = int(table[pos // BS]) * BS + pos % BS
    h0 = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(pos))
    ref_caches, caches = _caches(pos, hd), _caches(pos, hd)
    want_out, want_h = decode_stack_ref(layers, norm, shape, h0, pos, slot, pos + 1, table, ref_caches)
    h = h0.clone()
    out = DecodeStack(layers, norm, shape).step(h, pos, slot, pos + 1, table, caches)
    assert_same_step((out, h, caches), (want_out, want_h, ref_caches), h0, TOL)


def assert_same_step(got: tuple, want: tuple, h0: torch.Tensor, tol: dict) -> None:
    """(out, residual stream, caches) of the C step against the reference's, and the layers did something."""
    (out, h, caches), (want_out, want_h, ref_caches) = got, want
    assert out is not None
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(h, want_h, **tol)
    for (kc, vc), (rk, rv) in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(kc, rk, **tol)
        torch.testing.assert_close(vc, rv, **tol)
    assert (h - h0).abs().max() > 0.1


def test_step_ids_looks_the_token_up_and_follows_new_caches():
    """step_ids: the embedding row of input_ids[0] at positions[0] / slot_mapping[0], as step on that
    row; a token outside the vocabulary is refused; a new cache list is written, not the old one."""
    layers, norm, pos = _stack("Q4_1", 16), torch.ones(HIDDEN), 9
    embed = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(2))
    table = torch.tensor([[5, 2, 0, 4, 1, 3]], dtype=torch.int32)
    slot = int(table[0, pos // BS]) * BS + pos % BS
    stack = DecodeStack(layers, norm, SHAPE, embed=embed)
    want_caches, caches = _caches(pos), _caches(pos)
    want = stack.step(embed[7].clone(), pos, slot, pos + 1, table[0], want_caches)
    ids, positions, slots = torch.tensor([7]), torch.tensor([pos]), torch.tensor([slot])
    assert torch.equal(stack.step_ids(ids, positions, slots, pos + 1, table, caches), want)
    for (kc, vc), (wk, wv) in zip(caches, want_caches, strict=True):
        assert torch.equal(kc, wk) and torch.equal(vc, wv)
    assert stack.step_ids(torch.tensor([50]), positions, slots, pos + 1, table, caches) is None
    assert stack.step_ids(torch.tensor([-1]), positions, slots, pos + 1, table, caches) is None
    fresh, before = _caches(pos), [(k.clone(), v.clone()) for k, v in caches]
    assert torch.equal(stack.step_ids(ids, positions, slots, pos + 1, table, fresh), want)
    assert torch.equal(fresh[1][0], want_caches[1][0])  # this token's K/V went to the new list
    assert all(torch.equal(k, bk) for (k, _), (bk, _) in zip(caches, before, strict=True))  # the old one untouched


def test_refuses_positions_outside_the_rotary_table():
    stack = DecodeStack(_stack(None, None), torch.ones(HIDDEN), SHAPE)
    table = torch.arange(6, dtype=torch.int32)
    assert stack.step(torch.zeros(HIDDEN), SHAPE.max_positions, 0, 1, table, _caches(0)) is None


# The default build here is -march=native (AVX-512): these rebuild the step without the paths a smaller
# CPU lacks (AVX-512: the 16-bit GEMV's qa_block512, the float blocks' direct_block512; AVX2: the
# attention's FMA chains and register tiles), so that those paths stay checked on this machine.
FALLBACK_BUILDS = {"avx2": cpu_build.NO_AVX512, "scalar": cpu_build.SCALAR}


@pytest.fixture(scope="module", params=sorted(FALLBACK_BUILDS))
def fallback_lib(request, rebuilt):
    return rebuilt("decode_stack_cpu.c", FALLBACK_BUILDS[request.param], request.param)


@HEAD_DIMS
@pytest.mark.parametrize(("qtype", "bits"), [("Q4_1", 16), ("Q4_0", 16), ("Q8_0", None), ("Q4_1", 8)])
def test_fallback_builds_match_reference(fallback_lib, qtype, bits, hd):
    shape = StackShape(NH, NKV, hd, SHAPE.eps, SHAPE.rope_theta, SHAPE.max_positions)
    layers, norm, pos = _stack(qtype, bits, hd=hd), torch.ones(HIDDEN), 9
    table = torch.tensor([5, 2, 0, 4, 1, 3], dtype=torch.int32)
    slot = int(table[pos // BS]) * BS + pos % BS
    h0 = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(pos))
    ref_caches, caches = _caches(pos, hd), _caches(pos, hd)
    want_out, _ = decode_stack_ref(layers, norm, shape, h0, pos, slot, pos + 1, table, ref_caches)
    out = DecodeStack(layers, norm, shape, lib=fallback_lib).step(h0.clone(), pos, slot, pos + 1, table, caches)
    assert out is not None
    torch.testing.assert_close(out, want_out, **TOL)
