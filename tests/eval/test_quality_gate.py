"""Quality gates: engine configurations against HF transformers fp32 on the embedded SmolLM2, through
the functions `moebus eval` runs (moebus.eval.run), on a CI-sized subset: one 512-token chunk
(255 tokens scored through decode steps) and the first 10 prompts x 16 greedy tokens.

Bounds are ~2x what was measured (the figures beside each bound), except where the brief sets one.
"""
from __future__ import annotations

import pytest

from moebus.eval.configs import HF_BF16
from moebus.eval.run import Result, Settings, prepare, run_configs

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

pytest.importorskip("transformers")

SETTINGS = Settings(ctx=512, max_chunks=1, max_prompts=10, max_tokens=16)


class Measurements:
    """Each configuration measured once, on first use (one engine or HF model alive at a time)."""

    def __init__(self) -> None:
        self.reference, self.hf_path = prepare(SETTINGS)
        self.done: dict[str, Result] = {}

    def __call__(self, name: str) -> Result:
        if name not in self.done:
            r = self.done[name] = next(run_configs(SETTINGS, self.reference, self.hf_path, [name]))
            g = r.greedy
            print(f"\n{name}: PPL {r.ppl.ppl:.4f} vs HF fp32 {self.reference.stats.ppl:.4f} "
                  f"({100 * (self.ppl_ratio(name) - 1):+.3f}%), KL {r.ppl.kl:.2e}, same top "
                  f"{r.ppl.same_top_pct:.1f}%; greedy matched {g.matched}/{g.prompts}, ties {len(g.ties)}, "
                  f"diverged {[(d.prompt, d.position, round(d.margin, 4)) for d in g.real]}")
        return self.done[name]

    def ppl_ratio(self, name: str) -> float:
        return self(name).ppl.ppl / self.reference.stats.ppl


@pytest.fixture(scope="module")
def measure() -> Measurements:
    return Measurements()


def test_fp32_matches_hf_fp32(measure: Measurements) -> None:
    r = measure("fp32")
    assert abs(measure.ppl_ratio("fp32") - 1) < 1e-3
    assert r.ppl.kl < 1e-4
    assert not r.greedy.real, r.greedy.real  # every divergence (if any) is a tie


def test_bf16_ppl_within_1pct(measure: Measurements) -> None:
    assert abs(measure.ppl_ratio("bf16") - 1) < 1e-2


def test_bf16_greedy_agreement_at_least_hf_bf16s(measure: Measurements) -> None:
    ours, yardstick = measure("bf16").greedy, measure(HF_BF16).greedy
    assert ours.matched >= yardstick.matched, (ours.divergences, yardstick.divergences)


def test_gguf16_close_to_the_dequantized_model(measure: Measurements) -> None:
    r = measure("gguf16")
    assert abs(measure.ppl_ratio("gguf16") - 1) < 5e-3  # measured -0.005%
    assert r.ppl.kl < 3e-7  # measured 1.3e-7


def test_gguf8_within_a_looser_bound(measure: Measurements) -> None:
    r = measure("gguf8")
    assert abs(measure.ppl_ratio("gguf8") - 1) < 2.5e-2  # measured +1.13%
    assert r.ppl.kl < 2e-2  # measured 8.6e-3
