"""Spec decode: n-gram drafting, rejection sampling (greedy equivalence, statistics, seeds)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from moebus.engine.sampling import (
    DraftModelProposer,
    NgramProposer,
    Sampler,
    SamplingBatch,
    SamplingParams,
    SpecDecodeStats,
    make_generator,
    rejection_sample,
)

V = 48
EOS = 5


def build(params, outs, prompts, gens=None, vocab=V) -> SamplingBatch:
    gens = gens if gens is not None else [None] * len(params)
    return SamplingBatch.build(params, outs, prompts, gens, vocab, "cpu", eos_token_id=EOS)


def toy_model(context: list[int]) -> torch.Tensor:
    """Deterministic "LM": logits are a pure function of the context."""
    seed = hash(tuple(context)) % (2**31)
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ([1, 2, 3, 4, 1, 2, 3], [4, 1, 2]),  # longest suffix "1 2 3" recurs at 0
        ([1, 2, 9, 5, 1, 2, 7, 8, 1, 2], [7, 8, 1]),  # most recent of two "1 2" matches
        ([5, 6, 7, 3, 6, 7, 4, 8, 7], [4, 8, 7]),  # only the 1-gram "7" recurs; latest earlier: 5
        ([1, 2, 3, 4], []),  # no earlier occurrence
        ([7, 7, 7, 7], [7]),  # longest n wins even though its match leaves one token to propose
        ([1, 2, 1, 2, 1], [2, 1]),  # the match overlaps the suffix itself
        ([3, 1, 2, 3], [1, 2, 3]),
        ([4, 4], [4]),
        ([4], []),
        ([], []),
    ],
)
def test_ngram_proposer(tokens: list[int], expected: list[int]) -> None:
    assert NgramProposer(min_n=1, max_n=3, num_speculative_tokens=3).propose(tokens) == expected


def test_ngram_prefers_longest_match_and_respects_min_n() -> None:
    # "2 3" matches at 1 (followed by 8); the 1-gram "3" alone would pick the later 3 at 5 (-> 9).
    tokens = [1, 2, 3, 8, 0, 3, 9, 2, 3]
    assert NgramProposer(1, 2, 2).propose(tokens) == [8, 0]
    assert NgramProposer(1, 1, 2).propose(tokens) == [9, 2]
    assert NgramProposer(3, 3, 2).propose(tokens) == []
    assert NgramProposer(1, 3, 4).propose_batch([tokens, [1, 1]], None, 1) == [[8], [1]]
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_draft_model_protocol() -> None:
    class Mtp:
        def propose(self, batch_token_ids, hidden_states, k):
            return [[0] * k for _ in batch_token_ids]

    assert isinstance(Mtp(), DraftModelProposer)


def plain_decode(params, prompts, steps):
    outs = [[] for _ in params]
    for _ in range(steps):
        logits = torch.stack([toy_model(p + o) for p, o in zip(prompts, outs, strict=True)])
        tokens = Sampler()(logits, build(params, outs, prompts)).sampled_token_ids.tolist()
        for o, t in zip(outs, tokens, strict=True):
            o.append(t)
    return outs


def test_greedy_spec_equals_plain_greedy() -> None:
    k, steps = 4, 24
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.8, min_tokens=6),
        SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(top_k=1, min_tokens=10, stop_token_ids=[7], frequency_penalty=2.0),
    ]
    prompts = [[1, 2, 3], [4, 4, 4, 9], [10], [11, 12]]
    reference = plain_decode(params, prompts, steps + k + 1)
    rng = random.Random(0)
    outs, stats = [[] for _ in params], SpecDecodeStats()
    while min(len(o) for o in outs) < steps:
        num_draft = [rng.randint(0, k) for _ in params]
        drafts = torch.full((len(params), k), -1)
        for b, o in enumerate(outs):  # the true continuation, sometimes corrupted
            truth = reference[b][len(o) : len(o) + num_draft[b]]
            num_draft[b] = len(truth)
            drafts[b, : len(truth)] = torch.tensor([t if rng.random() < 0.8 else (t + 1) % V for t in truth])
        logits = torch.stack([
            torch.stack([toy_model(prompts[b] + o + drafts[b, :j].tolist()) for j in range(k + 1)])
            for b, o in enumerate(outs)
        ])
        emitted = rejection_sample(logits, drafts, num_draft, build(params, outs, prompts))
        stats.observe(num_draft, emitted)
        for o, e, nd in zip(outs, emitted, num_draft, strict=True):
            assert 1 <= len(e) <= nd + 1
            o.extend(e)
    for b in range(len(params)):
        assert outs[b][: len(reference[b])] == reference[b][: len(outs[b])]
    assert 0 < stats.acceptance_rate < 1 and stats.num_accepted > 0


def test_min_tokens_ban_moves_with_draft_position() -> None:
    # EOS is the favourite everywhere; runner-up s_j at position j. Output so far: 1 token.
    runner_up = [8, 9, 10, 11]
    logits = torch.zeros(1, 4, V)
    logits[0, :, EOS] = 10.0
    logits[0, torch.arange(4), runner_up] = 5.0
    params = [SamplingParams(temperature=0.0, min_tokens=3)]
    drafts = torch.tensor([runner_up[:3]])
    emitted = rejection_sample(logits, drafts, [3], build(params, [[1]], [[0]]))
    # Positions 0 and 1 (lengths 1, 2) still ban EOS, so the drafts match; position 2 may stop.
    assert emitted == [[8, 9, EOS]]


def test_sampled_acceptance_matches_theory() -> None:
    n, vocab = 40000, 8
    p = SamplingParams(temperature=0.8, top_k=6)
    logits = torch.randn(2, vocab, generator=make_generator(3)) * 1.5
    x = int(logits[0].argsort(descending=True)[1])  # the second most likely token
    expect = [torch.where(r >= r.topk(6).values[-1], r / 0.8, -math.inf).softmax(0) for r in logits.double()]
    target = logits.expand(n, 2, vocab).contiguous()
    drafts = torch.full((n, 1), x)
    batch = build([p] * n, [[]] * n, [[]] * n, vocab=vocab)
    emitted = rejection_sample(target, drafts, [1] * n, batch, generator=make_generator(0))
    accepted = torch.tensor([len(e) == 2 for e in emitted])
    first = torch.tensor([e[0] for e in emitted])
    rate, p_x = accepted.double().mean().item(), expect[0][x].item()
    assert abs(rate - p_x) < 5 * math.sqrt(p_x * (1 - p_x) / n)
    # Spec decode must not change the distribution: first token ~ p0, bonus ~ p1.
    assert_chi_square(torch.bincount(first, minlength=vocab), expect[0])
    bonus = torch.tensor([e[1] for e in emitted if len(e) == 2])
    assert_chi_square(torch.bincount(bonus, minlength=vocab), expect[1])
    rejected_to = torch.tensor([e[0] for e in emitted if len(e) == 1])
    assert (rejected_to != x).all()


def test_draft_probs_keep_target_distribution() -> None:
    n, vocab = 40000, 6
    logits = torch.randn(2, vocab, generator=make_generator(8))
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    drafts = torch.multinomial(q, n, replacement=True, generator=make_generator(9))[:, None]
    batch = build([SamplingParams()] * n, [[]] * n, [[]] * n, vocab=vocab)
    emitted = rejection_sample(
        logits.expand(n, 2, vocab).contiguous(), drafts, [1] * n, batch,
        draft_probs=q.expand(n, 1, vocab), generator=make_generator(1),
    )
    p0 = logits[0].double().softmax(0)
    assert_chi_square(torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=vocab), p0)
    rate = sum(len(e) == 2 for e in emitted) / n
    theory = float(torch.minimum(p0, q.double()).sum())  # P(accept) = sum_x min(p, q)
    assert abs(rate - theory) < 0.02


def test_seeded_spec_row_is_batch_invariant() -> None:
    p = SamplingParams(temperature=1.0, seed=42)
    prompt, out = [1, 2], [3]
    row_logits = torch.randn(1, 4, V, generator=make_generator(2))  # K = 3 drafts
    draft = torch.tensor([[4, 9, 13]])
    alone = rejection_sample(row_logits, draft, [3], build([p], [out], [prompt], [make_generator(42)]))
    # Same request inside a wider batch with K = 5 and unseeded neighbours.
    others = torch.randn(2, 6, V)
    logits = torch.cat([others[:1], torch.cat([row_logits, torch.randn(1, 2, V)], 1), others[1:]])
    drafts = torch.tensor([[1, 2, 3, 4, 5], [4, 9, 13, -1, -1], [6, 7, 8, 9, 10]])
    batch = build([SamplingParams(), p, SamplingParams(top_p=0.5)], [[], out, [1]], [[], prompt, [2]],
                  [None, make_generator(42), None])
    together = rejection_sample(logits, drafts, [5, 3, 2], batch)
    assert together[1] == alone[0]


def test_rejection_sample_validates() -> None:
    batch = build([SamplingParams()], [[]], [[]])
    with pytest.raises(ValueError):
        rejection_sample(torch.randn(1, 3, V), torch.zeros(1, 1, dtype=torch.long), [1], batch)


def assert_chi_square(counts: torch.Tensor, probs: torch.Tensor) -> None:
    n = counts.sum()
    expected = probs.double() * n
    keep = expected > 5
    assert (counts[probs == 0] == 0).all()
    stat = float((((counts.double() - expected) ** 2) / expected)[keep].sum())
    df = int(keep.sum()) - 1
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)


def test_spec_decode_stats() -> None:
    stats = SpecDecodeStats()
    stats.observe([3, 0, 2], [[1, 2, 3, 4], [5], [6]])  # 3 of 3 accepted, no draft, 0 of 2
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted) == (2, 5, 3)
    assert stats.acceptance_rate == 0.6
    assert SpecDecodeStats().acceptance_rate == 0.0
