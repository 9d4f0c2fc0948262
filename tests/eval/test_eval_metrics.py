"""moebus.eval's metric functions against values worked out by hand (float64)."""
from __future__ import annotations

import math

import pytest
import torch

from moebus.eval.metrics import (
    Divergence,
    PerplexityStats,
    first_divergence,
    greedy_stats,
    margin,
    same_top,
    token_kl,
    token_nll,
)

LN3 = math.log(3.0)
# Row 0: p = softmax([0, ln 3]) = [1/4, 3/4]; row 1: p = softmax([ln 2, 0]) = [2/3, 1/3].
REF = torch.tensor([[0.0, LN3], [math.log(2.0), 0.0]], dtype=torch.float64)
UNIFORM = torch.zeros(2, 2, dtype=torch.float64)  # q = [1/2, 1/2] on both rows


def test_nll_is_minus_log_prob_of_the_target() -> None:
    nll = token_nll(REF, torch.tensor([1, 1]))
    assert nll.dtype == torch.float64
    torch.testing.assert_close(nll, torch.tensor([math.log(4 / 3), math.log(3.0)], dtype=torch.float64))


def test_kl_is_ref_to_candidate_in_nats() -> None:
    forward = [0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5),
               2 / 3 * math.log((2 / 3) / 0.5) + 1 / 3 * math.log((1 / 3) / 0.5)]
    backward = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL(q || p) of row 0
    kl = token_kl(REF, UNIFORM)
    torch.testing.assert_close(kl, torch.tensor(forward, dtype=torch.float64))
    assert abs(kl[0].item() - backward) > 1e-3  # the direction matters: this is KL(ref || candidate)
    torch.testing.assert_close(token_kl(REF, REF + 5.0), torch.zeros(2, dtype=torch.float64))  # shift-invariant


def test_kl_survives_float32_logits_of_a_large_vocab() -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 50_000, generator=g) * 4
    cand = ref + torch.randn(3, 50_000, generator=g) * 1e-3
    kl = token_kl(ref, cand)
    assert (kl > 0).all() and (kl < 1e-5).all()  # float32 softmax would lose these in rounding


def test_same_top_compares_argmaxes() -> None:
    cand = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    assert same_top(REF, cand).tolist() == [True, False]


def test_margin_is_the_reference_logit_gap() -> None:
    row = torch.tensor([1.0, 3.5, 2.0])
    assert margin(row, 1, 2) == pytest.approx(1.5)
    assert margin(row, 2, 1) == pytest.approx(-1.5)


def test_first_divergence_over_the_common_length() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([5], [6]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None


def test_perplexity_stats_weight_every_token_alike() -> None:
    stats = PerplexityStats()
    stats.add(UNIFORM, torch.tensor([1, 1]), REF)  # nll ln 2 twice; argmaxes 0, 0 against REF's 1, 0
    stats.add(REF, torch.tensor([1, 0]), REF)  # nll ln(4/3), ln(3/2); KL 0; both tops agree
    nll = (2 * math.log(2.0) + math.log(4 / 3) + math.log(3 / 2)) / 4
    kl = (0.25 * math.log(0.5) + 0.75 * math.log(1.5) + 2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3)) / 4
    assert stats.tokens == 4
    assert stats.nll == pytest.approx(nll, rel=1e-12)
    assert stats.ppl == pytest.approx(math.exp(nll), rel=1e-12)
    assert stats.kl == pytest.approx(kl, rel=1e-12)
    assert stats.same_top_pct == pytest.approx(75.0)


def test_greedy_stats_split_ties_from_divergences() -> None:
    ref_tokens = [[0, 1, 2], [0, 1, 2], [3, 3, 3]]
    logits = [torch.tensor([[0.0, 0.0, 0.0, 0.0]] * 3),
              torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 5.0, 4.995, 0.0], [0.0, 0.0, 0.0, 0.0]]),
              torch.tensor([[0.0, 0.0, 0.0, 2.0]] * 3)]
    ours = [[0, 1, 2], [0, 2, 0], [0, 3, 3]]
    g = greedy_stats(ref_tokens, logits, ours, tie_margin=0.01)
    assert g.matched == 1
    assert [(d.prompt, d.position) for d in g.divergences] == [(1, 1), (2, 0)]
    assert g.divergences[0].margin == pytest.approx(0.005, abs=1e-6)
    assert g.ties == [g.divergences[0]] and g.real == [g.divergences[1]]
    assert g.real[0].margin == pytest.approx(2.0)
    assert not greedy_stats(ref_tokens, logits, ours, tie_margin=0.001).ties


def test_a_negative_margin_is_a_tie() -> None:
    """The reference's own greedy step can pick a token its full forward ranks a hair lower."""
    g = greedy_stats([[1]], [torch.tensor([[0.0, 1.0, 1.0 + 1e-5]])], [[2]], tie_margin=0.01)
    assert g.ties == [Divergence(0, 0, pytest.approx(-1e-5, abs=1e-7))]
