"""The LM head as the engine reads it: float32 logits and greedy tokens on every path, one tie rule."""
from __future__ import annotations

import pytest
import torch

from moebus.engine.lm_head import LMHead, float_logits
from moebus.kernels.lm_head_argmax import lm_head_argmax_ref
from moebus.platforms.cpu.packed_linear import pack_linears, panels_wanted

WIDE = 129  # rows past the old decode sizes: the fused kernel and the wide logits where there are no panels
ROWS = (1, 3, 16, 64, 128, WIDE)


class _Tied(torch.nn.Module):
    """A model whose LM head is its token embedding (SmolLM2's layout)."""

    lm_head = None

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(*w.shape, dtype=w.dtype)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(w)


def _heads(w: torch.Tensor) -> dict[str, LMHead]:
    """The same weight as a plain tied head and as pack_linears leaves it (packed, with panels)."""
    packed = _Tied(w)
    pack_linears(packed)
    return {"tied": LMHead.of(_Tied(w)), "packed": LMHead.of(packed)}


def _calls(dtype: torch.dtype, seed: int):
    """(head form, head, x, w, x . w in float64) for each head form and row count of ROWS."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(4096, 128, generator=g) * 0.1).to(dtype)
    for name, head in _heads(w).items():
        for rows in ROWS:
            x = torch.randn(rows, 128, generator=g).to(dtype)
            yield name, head, x, w, x.double() @ w.double().T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_float32_sums_at_every_row_count(dtype):
    for name, head, x, _w, exact in _calls(dtype, 0):
        got = head.logits(x)
        assert got.dtype == torch.float32 and got.shape == exact.shape
        # float32 sums of the products: within a few float32 ulps of float64, far below bf16's steps
        assert (got.double() - exact).abs().max() < 1e-4, (name, x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_the_first_maximum_of_the_float32_logits(dtype):
    for name, head, x, w, exact in _calls(dtype, 1):
        got = head.greedy(x)
        assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
        # only the summation order differs from the reference: a disagreement is a float32 near-tie
        picked = exact.gather(1, got.view(-1, 1)).view(-1)
        assert torch.all(picked >= exact.max(dim=1).values - 1e-4), (name, x.shape)
        assert (got == lm_head_argmax_ref(x, w)).float().mean() > 0.95, (name, x.shape)


def _near_tie(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits near 25 where token 201 leads token 7 by 0.06: bf16 (steps of 0.125 there) rounds the
    two to one value, and the first maximum would then be 7, the "L'Étoile" failure of bf16."""
    w = torch.zeros(256, 64)
    w[7, 0], w[201, 0] = 25.0, 25.0
    w[201, 1] = 0.0625  # exact in bf16
    x = torch.zeros(5, 64)
    x[:, 0], x[:, 1] = 1.0, 1.0
    return x.to(dtype), w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_near_tie_is_decided_by_the_float32_logits(dtype):
    x, w = _near_tie(dtype)
    assert torch.nn.functional.linear(x, w)[0, 201] == torch.nn.functional.linear(x, w)[0, 7] or dtype != torch.bfloat16
    for name, head in _heads(w).items():
        assert head.greedy(x).tolist() == [201] * 5, name
        assert head.logits(x).argmax(-1).tolist() == [201] * 5, name
        big = x.repeat(WIDE, 1)
        assert set(head.greedy(big).tolist()) == {201} == set(head.logits(big).argmax(-1).tolist()), name
    model = _Tied(w)
    assert float_logits(None, model.embed_tokens, x).argmax(-1).tolist() == [201] * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_ties_go_to_the_lowest_token_id_on_every_path(dtype):
    w = torch.randn(256, 64) * 0.1
    w[200] = w[7]
    w = w.to(dtype)
    x = w[7:8].float().repeat(5, 1).to(dtype) * 3  # rows aligned with w[7] (and w[200])
    for name, head in _heads(w).items():
        for rows in (x, x.repeat(WIDE, 1)):
            assert set(head.greedy(rows).tolist()) == {7}, name
            assert set(head.logits(rows).argmax(-1).tolist()) == {7}, name


@pytest.mark.skipif(not panels_wanted(torch.bfloat16), reason="the panel kernel is not taken on this CPU")
def test_every_call_takes_the_panel_kernel_and_a_row_ignores_its_batch():
    w = torch.randn(256, 64).to(torch.bfloat16)
    head = LMHead.of(_Tied(w))
    assert head.panel is not None and head.panel.out_dtype == torch.float32
    x = torch.randn(300, 64).to(torch.bfloat16)
    assert torch.equal(head.logits(x), head.panel(x))
    alone = torch.cat([head.logits(x[i:i + 1]) for i in range(0, 300, 37)])
    assert torch.equal(alone, head.logits(x)[::37])


def test_a_quantized_head_gives_float32_logits_for_bf16_rows():
    from moebus.engine.quant_linear import QuantLinear

    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (64, 2 * 34), dtype=torch.uint8, generator=g)
    blocks.view(64, 2, 34)[:, :, :2] = torch.tensor([0, 0x2C], dtype=torch.uint8)  # fp16 scale 0.0625
    head = QuantLinear(blocks, "Q8_0", 64)

    class Model(torch.nn.Module):
        lm_head = head
        embed_tokens = None

    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    lm = LMHead.of(Model())
    want = head(x.float())
    assert lm.logits(x).dtype == torch.float32
    torch.testing.assert_close(lm.logits(x), want)
    assert torch.equal(lm.greedy(x), want.argmax(-1))


def test_a_head_with_a_bias_adds_it_in_float32():
    head = torch.nn.Linear(64, 256, bias=True).to(torch.bfloat16)

    class Model(torch.nn.Module):
        lm_head = head
        embed_tokens = None

    x = torch.randn(3, 64).to(torch.bfloat16)
    lm = LMHead.of(Model())
    want = x.double() @ head.weight.double().T + head.bias.double()
    got = lm.logits(x)
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 1e-4
    assert torch.equal(lm.greedy(x), got.argmax(-1))
