import pytest
import torch
from torch import nn

import moebus.platforms.cpu.packed_linear as cl
from moebus.platforms.cpu.packed_linear import (
    PACKED_MIN_MACS,
    PackedLinear,
    pack_linears,
    packed_max_rows,
    packing_available,
    panels_wanted,
)

# bf16 packing needs AVX-512 or AVX-NE-CONVERT; fp32 packing works wherever oneDNN does.
DTYPES = [pytest.param(dt, marks=pytest.mark.skipif(not packing_available(dt), reason=f"no oneDNN {dt} packing"))
          for dt in (torch.float32, torch.bfloat16)]
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_matches_plain_linear_for_every_row_count(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160, bias=False), nn.Linear(160, 40, bias=True)).to(dtype)
    plain = [m.weight.clone() for m in model]
    cap = packed_max_rows(dtype) or 512
    x = torch.randn(cap + 5, 96, dtype=dtype)
    expected = model(x)
    assert pack_linears(model) == 2 and all(type(m) is PackedLinear for m in model)
    assert all(torch.equal(m.weight, w) for m, w in zip(model, plain, strict=True))  # shared, untouched
    for rows in (1, 7, 64, cap, cap + 5):  # packed (and for bf16 the plain path above the cap)
        torch.testing.assert_close(model(x[:rows]), expected[:rows], **TOL[dtype])
    assert model(x[:3].view(1, 3, 96)).shape == (1, 3, 40)


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_calls_take_the_plain_gemm(dtype):
    """Below PACKED_MIN_MACS the call is F.linear itself (bitwise); above it, the packed GEMM; where
    the panel kernel is taken, it takes both."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 32, bias=False).to(dtype)
    model = nn.Sequential(layer)
    pack_linears(model)
    packed = model[0]
    assert packed.min_rows == max(-(-PACKED_MIN_MACS[dtype] // (64 * 32)), 0)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    x = torch.randn(packed.min_rows + 3, 64, dtype=dtype)
    torch.ops.mkldnn._linear_pointwise = spy
    try:
        small = packed(x[:max(packed.min_rows - 1, 1)])
        packed(x)
    finally:
        torch.ops.mkldnn._linear_pointwise = real
    if packed.panels is not None:  # every row count takes the panel kernel instead
        assert calls == []
        torch.testing.assert_close(small, torch.nn.functional.linear(x[:small.shape[0]], layer.weight), **TOL[dtype])
    elif packed.min_rows > 1:
        assert torch.equal(small, torch.nn.functional.linear(x[:packed.min_rows - 1], layer.weight))
        assert calls == [x.shape[0]]  # only the large call was packed
    else:
        assert calls == [1, x.shape[0]]


PANELS = pytest.mark.skipif(not (packing_available(torch.bfloat16) and panels_wanted(torch.bfloat16)),
                            reason="the panel kernel serves bf16 on AVX512-BF16 CPUs without AMX only")


@PANELS
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_calls_of_every_size_take_the_panel_kernel(bias):
    torch.manual_seed(0)
    layer = nn.Linear(96, 48, bias=bias).to(torch.bfloat16)
    model = nn.Sequential(layer)
    pack_linears(model)
    packed = model[0]
    assert packed.panels is not None
    x = torch.randn(2049, 96, dtype=torch.bfloat16)
    calls = []
    real_panel, real_dnn = cl.PanelLinear.__call__, torch.ops.mkldnn._linear_pointwise
    cl.PanelLinear.__call__ = lambda self, x: calls.append(("panel", x.shape[0])) or real_panel(self, x)
    torch.ops.mkldnn._linear_pointwise = lambda *a: calls.append(("onednn", a[0].shape[0])) or real_dnn(*a)
    try:
        for rows in (1, 5, 128, 2049):
            out = packed(x[:rows])
            ref = x[:rows].double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)
            torch.testing.assert_close(out.double(), ref, **TOL[torch.bfloat16])
    finally:
        cl.PanelLinear.__call__, torch.ops.mkldnn._linear_pointwise = real_panel, real_dnn
    assert calls == [("panel", 1), ("panel", 5), ("panel", 128), ("panel", 2049)]  # batch invariance


@PANELS
def test_a_shape_the_panel_kernel_does_not_take_keeps_onednn():
    model = nn.Sequential(nn.Linear(40, 48, bias=False).to(torch.bfloat16))  # in 40: not whole k pairs of 32
    pack_linears(model)
    assert model[0].panels is None
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    torch.testing.assert_close(model(x), torch.nn.functional.linear(x, model[0].weight), **TOL[torch.bfloat16])


@PANELS
def test_the_greedy_head_shares_the_tied_heads_panels():
    from moebus.engine.lm_head import LMHead

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens, self.lm_head = nn.Embedding(160, 64), None
    torch.manual_seed(0)
    model = Tied().to(torch.bfloat16)
    pack_linears(model)
    head = LMHead.of(model)
    assert head.panels is model.lm_head.panels  # the panel kernel's head (panels_wanted) and the fused one
    assert head.panel is not None and head.panel.panels is model.lm_head.panels
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = model.embed_tokens.weight
    assert torch.equal(head.greedy(x), torch.nn.functional.linear(x.float(), w.float()).argmax(-1))


def test_only_packable_dtypes_are_packed():
    model = nn.Sequential(nn.Linear(8, 8).half(), nn.Linear(8, 8), nn.Linear(8, 8).bfloat16())
    expected = [PackedLinear if packing_available(m.weight.dtype) else nn.Linear for m in model]
    assert not packing_available(torch.float16)
    assert pack_linears(model) == sum(t is PackedLinear for t in expected)
    assert [type(m) for m in model] == expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_lm_head_gets_a_packed_head_sharing_the_embedding(dtype):
    from moebus.engine.models.llama import LlamaArgs, LlamaForCausalLM

    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    model = LlamaForCausalLM(args).to(dtype)
    hidden = torch.randn(5, 64, dtype=dtype)
    expected = model.compute_logits(hidden)
    assert model.lm_head is None
    pack_linears(model)
    assert type(model.lm_head) is PackedLinear and model.lm_head.weight is model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())  # shared, not a second parameter
    torch.testing.assert_close(model.compute_logits(hidden), expected, **TOL[dtype])


@pytest.mark.skipif(packing_available(torch.bfloat16), reason="this CPU packs bf16")
def test_unpackable_bf16_warns_and_stays_plain(caplog):
    model = nn.Sequential(nn.Linear(8, 8).bfloat16())
    with caplog.at_level("WARNING"):
        assert pack_linears(model) == 0
    assert type(model[0]) is nn.Linear and "serve with dtype float32" in caplog.text
