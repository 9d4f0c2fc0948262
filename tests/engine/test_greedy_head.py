"""The runner's greedy head: the token ids of greedy rows straight from the LM head's weight."""
from __future__ import annotations

import functools

import pytest
import torch

from moebus.engine.cpu_linear import PANEL_MAX_ROWS, panels_wanted
from moebus.engine.model_runner import _greedy_head, _panel_greedy
from moebus.kernels.lm_head_argmax import lm_head_argmax_ref


class _Tied(torch.nn.Module):
    """A model whose LM head is its token embedding (SmolLM2's layout)."""

    lm_head = None

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_head_matches_the_reference_at_every_row_count(dtype):
    g = torch.Generator().manual_seed(0)
    model = _Tied(4096, 128, dtype)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(4096, 128, generator=g) * 0.1)
    head = _greedy_head(model)
    assert isinstance(head, functools.partial)
    # CPUs where PackedLinear takes the panel kernel take it for the head too; others the fused kernel
    assert (head.func is _panel_greedy) == panels_wanted(dtype)
    w = model.embed_tokens.weight.detach()
    for rows in (1, 3, 16, 64, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1):  # the last falls back to the fused kernel
        x = torch.randn(rows, 128, generator=g).to(dtype)
        got, want = head(x), lm_head_argmax_ref(x, w)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        logits = torch.nn.functional.linear(x, w).float()
        # only the summation order may differ: where the two disagree, the logits nearly tie
        picked = logits.gather(1, got.view(-1, 1)).view(-1)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.all(picked >= logits.max(dim=1).values - tol), rows
        assert (got == want).float().mean() > 0.9, rows


@pytest.mark.skipif(not panels_wanted(torch.bfloat16), reason="the panel kernel is not taken on this CPU")
def test_panel_greedy_takes_the_first_of_tied_maxima():
    """The reference's semantics: logits in the storage dtype, then the first maximum. Two equal
    weight rows give exactly equal logits, so the lower id must win."""
    w = torch.randn(256, 64) * 0.1
    w[200] = w[7]
    w = w.to(torch.bfloat16)
    x = w[7:8].float().repeat(5, 1).to(torch.bfloat16) * 3  # rows aligned with w[7] (and w[200])
    head = _greedy_head(_with_weight(w))
    assert head.func is _panel_greedy
    assert head(x).tolist() == [7] * 5 == lm_head_argmax_ref(x, w).tolist()


def _with_weight(w: torch.Tensor) -> torch.nn.Module:
    model = _Tied(w.shape[0], w.shape[1], w.dtype)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(w)
    return model
