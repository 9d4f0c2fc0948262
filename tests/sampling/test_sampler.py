"""Sampler checks, each against an independent per-row reference computation."""
from __future__ import annotations

import math

import pytest
import torch

from moebus.engine.sampling import (
    Sampler,
    SamplingBatch,
    SamplingParams,
    make_generator,
)
from moebus.engine.sampling.sampler import advance_generator, prepare_logits, sampling_probs

V = 64


def build(params, outs=None, prompts=None, gens=None, vocab=V, **kw) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        outs if outs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        gens if gens is not None else [None] * n,
        vocab,
        "cpu",
        **kw,
    )


def ref_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Straightforward float64 per-row reference: temperature, top-k, top-p, min-p, softmax."""
    x = row.double() / p.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if p.top_k > 0:
        kth = x.sort(descending=True).values[p.top_k - 1]
        keep &= x >= kth
    if p.top_p < 1:
        probs = torch.where(keep, x, -math.inf).softmax(0)
        cum, kept = 0.0, torch.zeros_like(keep)
        for i in probs.argsort(descending=True).tolist():
            if cum >= p.top_p or probs[i] == 0:
                break
            kept[i] = True
            cum += float(probs[i])
        keep &= kept
    if p.min_p > 0:
        probs = torch.where(keep, x, -math.inf).softmax(0)
        keep &= probs >= p.min_p * probs.max()
    return torch.where(keep, x, -math.inf).softmax(0)


TRUNCATION_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=V),
    SamplingParams(temperature=1.0, top_p=0.05),  # keeps only the top token
]


@pytest.mark.parametrize("mixed", [False, True])
def test_truncation_matches_reference(mixed: bool) -> None:
    torch.manual_seed(0)
    cases = TRUNCATION_CASES if mixed else TRUNCATION_CASES[1:2]
    logits = torch.randn(len(cases), V) * 3
    batch = build(cases)
    probs = sampling_probs(prepare_logits(logits, batch), batch)
    for i, p in enumerate(cases):
        ref = ref_probs(logits[i], p)
        assert torch.equal(probs[i] > 0, ref > 0), f"row {i}: kept set differs"
        torch.testing.assert_close(probs[i].double(), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0])
def test_wide_vocab_truncation_matches_reference(scale: float) -> None:
    """A vocabulary past the 64 logits truncation_floor sorts first: flat rows (scale 0.3) hold
    top-p nuclei of thousands of tokens, so it widens its sorted candidates up to the whole row."""
    vocab = 3000
    cases = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
             SamplingParams(temperature=1.5, top_k=700, top_p=0.5, min_p=0.01), SamplingParams(temperature=1.0),
             SamplingParams(temperature=0.0, top_p=0.3)]  # a greedy row: its own top_p must not matter
    logits = torch.randn(len(cases), vocab, generator=make_generator(9)) * scale
    batch = build(cases, vocab=vocab)
    probs = sampling_probs(prepare_logits(logits, batch), batch)
    for i, p in enumerate(cases[:4]):
        ref = ref_probs(logits[i], p)
        assert torch.equal(probs[i] > 0, ref > 0), f"row {i}: kept set differs"
        torch.testing.assert_close(probs[i].double(), ref, atol=1e-6, rtol=1e-5)


def test_top_p_keeps_ties_with_its_last_token() -> None:
    logits = torch.tensor([[3.0, 0.0, 3.0, 1.0, 3.0, 0.0]])
    batch = build([SamplingParams(top_p=0.1)], vocab=6)
    probs = sampling_probs(prepare_logits(logits, batch), batch)
    assert (probs[0] > 0).tolist() == [True, False, True, False, True, False]


def test_top_k_keeps_ties() -> None:
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0, 0.0]])
    batch = build([SamplingParams(top_k=2)], vocab=6)
    probs = sampling_probs(prepare_logits(logits, batch), batch)
    assert (probs[0] > 0).tolist() == [True, False, True, False, True, False]


def test_greedy_is_argmax_and_ignores_rng() -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, V)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(top_k=1, temperature=5.0) for i in range(16)]
    out = Sampler()(logits, build(params))
    assert torch.equal(out.sampled_token_ids, logits.argmax(1))
    assert out.logprobs is None


def naive_penalties(logits, params, outs, prompts):
    x = logits.clone()
    for i, p in enumerate(params):
        seen = set(outs[i]) | set(prompts[i])
        for t in range(x.shape[1]):
            if t in seen and p.repetition_penalty != 1.0:
                v = float(x[i, t])
                x[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            c = outs[i].count(t)
            x[i, t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return x


def test_penalties_match_naive_loop() -> None:
    torch.manual_seed(2)
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0),
        SamplingParams(),
    ]
    outs = [[1, 2, 2, 5], [3, 3, 3, 0], [7, 1, 7], []]
    prompts = [[9, 1, 40, V + 3], [], [2, 2, 63, -1], [5, 6]]  # ids past the vocabulary are dropped
    logits = torch.randn(4, V) * 2
    got = prepare_logits(logits, build(params, outs, prompts))
    torch.testing.assert_close(got, naive_penalties(logits, params, outs, prompts))
    assert torch.equal(got[3], logits[3])
    # Greedy rows take the argmax of the penalized logits.
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=1e3) for _ in range(4)]
    tokens = Sampler()(logits, build(greedy, outs, prompts)).sampled_token_ids
    assert torch.equal(tokens, naive_penalties(logits, greedy, outs, prompts).argmax(1))


def test_min_tokens_bans_stops_until_reached() -> None:
    eos, stop = 3, 7
    logits = torch.zeros(4, V)
    logits[:, [eos, stop]] = 100.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop]),
        SamplingParams(min_tokens=5, stop_token_ids=[stop], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=5),
    ]
    outs = [[1], [1, 2], [], [1, 1, 1, 1, 1]]
    tokens = Sampler()(logits, build(params, outs, eos_token_id=eos)).sampled_token_ids.tolist()
    assert tokens[0] not in (eos, stop)  # 1 < min_tokens: both banned
    assert tokens[1] in (eos, stop)  # reached min_tokens
    assert tokens[2] == eos  # ignore_eos: eos is not a stop, only `stop` is banned
    assert tokens[3] == eos


def test_allowed_mask_restricts_sampling_and_greedy() -> None:
    torch.manual_seed(3)
    b = 32
    logits = torch.randn(b, V) * 4
    mask = torch.rand(b, V) < 0.2
    mask[:, 0] = True
    params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 1.5) for i in range(b)]
    out = Sampler(make_generator(0))(logits, build(params, allowed_token_mask=mask))
    tokens = out.sampled_token_ids
    assert mask.gather(1, tokens[:, None]).all()
    masked_argmax = logits.masked_fill(~mask, -math.inf).argmax(1)
    assert torch.equal(tokens[::4], masked_argmax[::4])


def test_grammar_beats_min_tokens_when_only_stops_are_allowed() -> None:
    mask = torch.zeros(1, V, dtype=torch.bool)
    mask[0, 3] = True  # the grammar is complete: only eos allowed
    batch = build([SamplingParams(min_tokens=4)], allowed_token_mask=mask, eos_token_id=3)
    assert Sampler()(torch.randn(1, V), batch).sampled_token_ids.item() == 3


def test_seeded_row_is_batch_invariant() -> None:
    torch.manual_seed(4)
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    steps, alone, together = 12, [], []
    gen_alone, gen_batched = make_generator(1234), make_generator(1234)
    noise = Sampler(make_generator(99))
    for step in range(steps):
        row = torch.randn(1, V) * 2
        alone.append(noise(row, build([target], gens=[gen_alone])).sampled_token_ids.item())
        n_other = 1 + step % 5  # other rows: different count, params and positions each step
        others = torch.randn(n_other, V)
        logits = torch.cat([others[: n_other // 2], row, others[n_other // 2 :]])
        params = [SamplingParams(temperature=1.0 + i, top_k=3 + i, min_p=0.01) for i in range(n_other)]
        params.insert(n_other // 2, target)
        gens: list = [None] * (n_other + 1)
        gens[n_other // 2] = gen_batched
        tok = noise(logits, build(params, gens=gens, allowed_token_mask=None)).sampled_token_ids
        together.append(tok[n_other // 2].item())
    assert alone == together
    assert len(set(alone)) > 1  # it did sample, not a degenerate argmax


def test_temperature_only_rows_are_batch_invariant_and_reproducible() -> None:
    """The plain path (no top-k/top-p/min-p): a seeded row's tokens depend on its seed and logits
    only, whatever shares the batch; greedy rows there take their argmax; the generator advances
    exactly as advance_generator says (what a resumed request relies on)."""
    steps, target = 10, SamplingParams(temperature=1.0, seed=42)
    rows = torch.randn(steps, 1, V, generator=make_generator(8)) * 2
    runs = []
    for n_other in (0, 3, 8):
        gen, toks = make_generator(42), []
        shared = Sampler(make_generator(n_other))
        for step in range(steps):
            others = torch.randn(n_other, V) * 2
            logits = torch.cat([others[:1], rows[step], others[1:]]) if n_other else rows[step]
            params = [SamplingParams(temperature=0.0 if i % 2 else 0.5 + i) for i in range(n_other)]
            params.insert(min(1, n_other), target)
            gens = [None] * len(params)
            gens[min(1, n_other)] = gen
            out = shared(logits, build(params, gens=gens)).sampled_token_ids
            toks.append(out[min(1, n_other)].item())
            for i, p in enumerate(params):
                if p.greedy:
                    assert out[i].item() == logits[i].argmax().item()
        runs.append(toks)
        fresh = make_generator(42)
        advance_generator(fresh, steps)
        assert torch.equal(fresh.get_state(), gen.get_state())
    assert runs[0] == runs[1] == runs[2]
    assert len(set(runs[0])) > 1


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    expected = probs.double() * n
    keep = expected > 5
    stat = float((((counts.double() - expected) ** 2) / expected)[keep].sum())
    return stat, int(keep.sum()) - 1


def assert_chi_square(counts: torch.Tensor, probs: torch.Tensor) -> None:
    stat, df = chi_square(counts, probs)
    # ~5 standard deviations above the chi-square mean (df, var 2*df): a loose, fixed-seed test.
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_distribution_matches_softmax(seeded: bool) -> None:
    vocab, temp = 12, 0.8
    logits = torch.linspace(-2, 2, vocab) + torch.sin(torch.arange(vocab) * 1.7)
    expect = (logits.double() / temp).softmax(0)
    if seeded:  # one request over many steps with its own generator
        gen, sampler = make_generator(7), Sampler()
        batch = build([SamplingParams(temperature=temp, seed=7)], gens=[gen], vocab=vocab)
        draws = torch.tensor([sampler(logits[None], batch).sampled_token_ids.item() for _ in range(3000)])
    else:  # many rows at once from the shared generator
        n = 40000
        batch = build([SamplingParams(temperature=temp)] * n, vocab=vocab)
        draws = Sampler(make_generator(0))(logits.expand(n, vocab).contiguous(), batch).sampled_token_ids
    assert_chi_square(torch.bincount(draws, minlength=vocab), expect)


def test_truncated_distribution_matches_reference() -> None:
    vocab, n = 16, 40000
    p = SamplingParams(temperature=1.2, top_k=8, top_p=0.9, min_p=0.02)
    logits = torch.randn(vocab, generator=make_generator(5)) * 2
    draws = Sampler(make_generator(1))(
        logits.expand(n, vocab).contiguous(), build([p] * n, vocab=vocab)
    ).sampled_token_ids
    expect = ref_probs(logits, p)
    counts = torch.bincount(draws, minlength=vocab)
    assert (counts[expect == 0] == 0).all()
    assert_chi_square(counts, expect)


def test_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(6)
    params = [
        SamplingParams(logprobs=3, temperature=0.5, top_k=2, repetition_penalty=2.0),
        SamplingParams(logprobs=0),
        SamplingParams(),  # no logprobs: still gets a row, the caller ignores it
        SamplingParams(logprobs=5, temperature=0.0),
    ]
    logits = torch.randn(4, V) * 3
    out = Sampler(make_generator(0))(logits, build(params, [[1, 2]] * 4, [[3]] * 4))
    lp = out.logprobs
    ref = logits.double().log_softmax(1)
    tokens = out.sampled_token_ids
    torch.testing.assert_close(lp.sampled_logprobs.double(), ref.gather(1, tokens[:, None])[:, 0])
    assert lp.topk_ids.shape == (4, 5)
    for i in range(4):
        order = ref[i].argsort(descending=True)
        assert lp.topk_ids[i].tolist() == order[:5].tolist()
        assert lp.sampled_ranks[i] == (order == tokens[i]).nonzero().item() + 1
    sampled, rank, top = lp.row(0, 3)
    assert rank == lp.sampled_ranks[0].item() and sampled == lp.sampled_logprobs[0].item()
    assert [t[0] for t in top] == ref[0].argsort(descending=True)[:3].tolist()
    torch.testing.assert_close(torch.tensor([t[1] for t in top]).double(), ref[0].sort(descending=True).values[:3])


def test_build_validates_shapes() -> None:
    with pytest.raises(ValueError):
        SamplingBatch.build([SamplingParams()], [[]], [], [None], V, "cpu")
    with pytest.raises(ValueError):
        build([SamplingParams()], allowed_token_mask=torch.ones(1, V + 1, dtype=torch.bool))
    with pytest.raises(ValueError):
        Sampler()(torch.randn(2, V), build([SamplingParams()]))


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    logits = torch.randn(2, V)
    out = Sampler()(logits, build([SamplingParams(logprobs=0, temperature=0.0)] * 2))
    assert out.logprobs.topk_ids.shape == (2, 0)
    assert (out.logprobs.sampled_ranks == 1).all()
    torch.testing.assert_close(out.logprobs.sampled_logprobs, logits.log_softmax(1).amax(1))


@pytest.mark.parametrize("case", [
    ({}, 0, None, False),
    ({"temperature": 0.7}, 0, None, False),
    ({"top_k": 1, "temperature": 0.7}, 0, None, False),  # greedy via top_k
    ({"logprobs": 0}, 0, None, False),
    ({"repetition_penalty": 1.2}, 0, None, False),
    ({"presence_penalty": 0.5}, 0, None, False),
    ({"min_tokens": 3}, 1, 2, False),  # eos banned while 2 tokens are left
    ({"min_tokens": 3, "ignore_eos": True}, 1, 2, False),  # nothing to ban
    ({"min_tokens": 3, "stop_token_ids": [5]}, 3, None, False),  # reached: no ban
    ({"min_tokens": 3, "stop_token_ids": [5]}, 0, None, False),
    ({}, 0, None, True),  # a grammar mask
    ({"logit_bias": {3: 5.0}}, 0, None, False),
])
def test_takes_raw_argmax_agrees_with_the_built_batch(case):
    """The fast-path check must say yes exactly when build() gives a batch whose tokens are the
    argmax of the raw logits (all greedy, nothing for prepare_logits, no logprobs)."""
    from moebus.engine.sampling.batch import takes_raw_argmax

    kw, n_out, eos, masked = case
    p = SamplingParams(**({"temperature": 0.0} | kw))
    plain = SamplingParams(temperature=0.0)
    params, outs = [plain, p], [[7] * 4, [7] * n_out]
    mask = torch.ones(2, V, dtype=torch.bool) if masked else None
    b = build(params, outs, allowed_token_mask=mask, eos_token_id=eos)
    expected = b.all_greedy and not b.modifies_logits and b.max_num_logprobs is None
    assert takes_raw_argmax(params, [len(o) for o in outs], eos, masked) == expected


def test_logit_bias_is_added_to_its_row_before_everything() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={int(logits[1].argmax()): -100.0, 10**6: 1.0}),
              SamplingParams(temperature=0.0)]
    b = build(params)
    x = prepare_logits(logits, b)
    assert x[0, 7] == logits[0, 7] + 100 and torch.equal(x[2], logits[2])
    tokens = Sampler()(logits, b).sampled_token_ids.tolist()
    assert tokens[0] == 7 and tokens[1] != int(logits[1].argmax()) and tokens[2] == int(logits[2].argmax())
    # Sampled rows: a -100 bias takes the token out of reach; the raw logprobs stay the model's.
    banned = SamplingParams(temperature=1.0, logit_bias={t: -100.0 for t in range(V // 2)}, logprobs=1)
    out = Sampler(make_generator(1))(logits[:1].expand(200, V), build([banned] * 200))
    assert (out.sampled_token_ids >= V // 2).all()
    assert torch.allclose(out.logprobs.topk_logprobs[0, :1], logits[0].log_softmax(0).max().unsqueeze(0))


def test_logit_bias_bounds() -> None:
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias token ids"):
        SamplingParams(logit_bias={-1: 1.0})
