"""Shaping (window, speed-up, length scale and caps) and synthetic arrivals."""
from __future__ import annotations

import statistics

import pytest

from moebus.loadtest.prompts import PromptSynth, load_tokenizer
from moebus.loadtest.session import shaping_line
from moebus.loadtest.synthetic import SyntheticSpec, synthetic_trace
from moebus.loadtest.trace import BLOCK_TOKENS, Shaping, TraceRequest


def trace() -> list[TraceRequest]:
    return [TraceRequest(t, 1000 * (i + 1), 100, line=i + 1) for i, t in enumerate([0.0, 1.0, 2.0, 3.0, 10.0])]


def test_window_rebased_and_sped_up() -> None:
    out = Shaping(start_s=1.0, duration_s=2.5, time_scale=2.0).apply(trace())
    assert [r.arrival_s for r in out] == [0.0, 0.5, 1.0]
    assert [r.line for r in out] == [2, 3, 4]


def test_length_scale_and_caps() -> None:
    sh = Shaping(length_scale=0.01, max_input_tokens=25, max_output_tokens=1)
    out = sh.apply(trace())
    assert [r.input_tokens for r in out] == [10, 20, 25, 25, 25]
    assert {r.output_tokens for r in out} == {1}
    assert sh.block_tokens == 5
    assert Shaping(length_scale=1e-6).apply(trace())[0].input_tokens == 1, "never below one token"
    assert Shaping(max_requests=2).apply(trace())[-1].arrival_s == 1.0
    assert [r.output_tokens for r in Shaping(length_scale=0.01, output_scale=0.5).apply(trace())] == [50] * 5


def test_length_scale_keeps_every_hash_id() -> None:
    """Every id keeps a block of its own in the scaled prompt (the last one at least a token) and
    whole blocks stay whole; at x0.05, 1025 tokens scaled as a whole (51) would fit only 2 of its 3
    blocks of 26."""
    reqs = [TraceRequest(0.0, n, 1, hash_ids=list(range(100 * i, 100 * i - (-n // BLOCK_TOKENS))))
            for i, n in enumerate((1, 511, 512, 513, 1025, 1536, 4000, 10241))]
    reqs.append(TraceRequest(0.0, 1200, 1, hash_ids=[7]))  # tokens past its ids scale on their own
    for scale in (0.05, 0.03, 0.013, 0.5, 1.0, 2.0):
        sh = Shaping(length_scale=scale)
        b = sh.block_tokens
        for r, out in zip(reqs, sh.apply(reqs), strict=True):
            k, full = len(r.hash_ids), min(r.input_tokens, len(r.hash_ids) * BLOCK_TOKENS) // BLOCK_TOKENS
            n = out.input_tokens
            assert (k - 1) * b < n and full * b <= n, (scale, r.input_tokens, n)
            assert abs(n - r.input_tokens * scale) <= 0.5 * full + 1.5, (scale, r.input_tokens, n)
    out = Shaping(length_scale=0.05).apply([TraceRequest(0.0, 1025, 1, hash_ids=[1, 2, 3])])[0]
    assert out.input_tokens == 2 * 26 + 1
    synth = PromptSynth(load_tokenizer("toy"), block_tokens=26)
    last = synth.pieces_for(TraceRequest(0.0, 26, 1, hash_ids=[3]), 0)
    assert synth.pieces_for(out, 0)[2 * 26:] == last[:1], "the prompt starts the third id's block"


def test_closing_line_states_the_window() -> None:
    sh = Shaping(start_s=600.0, time_scale=2.0).describe()
    assert shaping_line(sh).endswith("window 600.0 s to the trace's end") and "None s" not in shaping_line(sh)
    assert shaping_line(Shaping().describe()).endswith("window: the whole trace")
    assert shaping_line(Shaping(start_s=5.0, duration_s=60.0).describe()).endswith("window 5.0 s + 60.0 s")


def test_bad_shaping() -> None:
    for kw in ({"time_scale": 0}, {"length_scale": -1}, {"duration_s": 0}, {"start_s": -1}, {"output_scale": 0}):
        with pytest.raises(ValueError):
            Shaping(**kw)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_synthetic_rate_and_seed(burstiness: float) -> None:
    spec = SyntheticSpec(rate=5.0, num_requests=2000, input_tokens=100, output_tokens=10, burstiness=burstiness,
                         length_dist="uniform", seed=3)
    reqs = synthetic_trace(spec)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.1)
    cv = statistics.stdev(gaps) / statistics.mean(gaps)  # gamma: CV = 1 / sqrt(shape)
    assert cv == pytest.approx(burstiness ** -0.5, rel=0.15)
    assert all(50 <= r.input_tokens <= 150 for r in reqs)
    assert synthetic_trace(spec) == reqs


def test_synthetic_fixed_lengths() -> None:
    reqs = synthetic_trace(SyntheticSpec(rate=1, num_requests=3, input_tokens=64, output_tokens=8))
    assert {(r.input_tokens, r.output_tokens) for r in reqs} == {(64, 8)} and reqs[0].arrival_s == 0
